"""What keeps /v1's time to first token short, checked for what it must not break."""

from __future__ import annotations

import threading

import pytest
from django.core.signals import request_started

from errors import InvalidRequest
from openai_api import calls
from openai_api.serializers import ChatCompletionRequestSerializer, CompletionRequestSerializer
from tests.platform.security.asgi_calls import call

pytestmark = pytest.mark.django_db(transaction=True)


def test_api_requests_start_no_thread_of_their_own():
    """Django's per-request ThreadSensitiveContext started a thread per request for the signal
    receivers; the API handler runs them on asgiref's one sync thread."""
    threads = []

    def note_thread(**_kwargs):
        threads.append(threading.current_thread().name)

    request_started.connect(note_thread)
    try:
        for _ in range(4):
            assert call("GET", "/v1/models").status_code == 401  # no key: the request still ran end to end
    finally:
        request_started.disconnect(note_thread)
    assert len(threads) == 4 and len(set(threads)) == 1, threads


def test_request_serializers_share_one_set_of_bound_fields():
    body = {"model": "m", "prompt": [1, 2]}
    assert CompletionRequestSerializer(data=body).fields is CompletionRequestSerializer(data=body).fields
    assert ChatCompletionRequestSerializer().fields is not CompletionRequestSerializer().fields


def test_shared_fields_validate_each_body_on_its_own_across_threads():
    """Two threads validating different bodies side by side each get their own values and errors."""
    failures = []

    def validate_many(offset: int):
        for i in range(200):
            n = offset + i
            body = {
                "model": f"m{n}",
                "prompt": [n, n + 1],
                "max_tokens": n % 50 + 1,
                "stream_options": {"include_usage": bool(n % 2)},
                "stream": True,
            }
            data = calls.validate(CompletionRequestSerializer, body)
            if (data["model"], data["prompt"], data["max_tokens"]) != (f"m{n}", [[n, n + 1]], n % 50 + 1) or data[
                "stream_options"
            ]["include_usage"] != bool(n % 2):
                failures.append((n, data))
            try:
                calls.validate(CompletionRequestSerializer, {**body, "temperature": "hot"})
                failures.append((n, "accepted a string temperature"))
            except InvalidRequest as refused:
                if refused.param != "temperature":
                    failures.append((n, refused.param))

    threads = [threading.Thread(target=validate_many, args=(offset,)) for offset in (0, 10_000)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert failures == []
