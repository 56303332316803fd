"""Quotas in the /v1 flow, in-process (Django test client + an engine worker thread on the test Redis)."""

from __future__ import annotations

import uuid

import pytest
from django.contrib.auth.models import User
from django.test import Client

from accounts.services import create_api_key
from quotas.selectors import quota_status
from tests.inference.worker_helpers import llm, serving_worker  # noqa: F401 (the llm fixture)
from usage.models import UsageRecord

pytestmark = pytest.mark.django_db(transaction=True)
PLAN = {
    "tokens_per_day": 100_000,
    "tokens_per_month": 1_000_000,
    "requests_per_minute": 2,
    "concurrent_requests": 5,
    "max_tokens_per_request": 64,
}


@pytest.fixture
def api(llm, settings):
    settings.QUOTA_REDIS_PREFIX = f"qapi-{uuid.uuid4().hex[:8]}"
    settings.QUOTA_DEFAULT_PLAN = PLAN
    settings.SERVED_MODEL_NAME = "tiny"
    worker = serving_worker(llm, "tiny", max_model_len=256)
    user = User.objects.create_user("quota-user", password="pw-long-enough")
    yield user, create_api_key(user)[1]
    worker.stop()


def post(raw_key, **body):
    return Client().post(
        "/v1/completions",
        {"model": "tiny", "prompt": [5, 6, 7, 8], **body},
        content_type="application/json",
        HTTP_AUTHORIZATION=f"Bearer {raw_key}",
    )


def test_requests_per_minute_refusal_is_a_429_with_retry_after_and_usage_is_settled(api):
    user, raw_key = api
    answers = [post(raw_key, max_tokens=5, ignore_eos=True) for _ in range(3)]
    assert [a.status_code for a in answers] == [200, 200, 429]
    assert answers[0]["x-ratelimit-limit-requests"] == "2"
    refused = answers[2]
    assert refused.json()["error"]["code"] == "rate_limit_exceeded"
    assert refused.json()["error"]["type"] == "rate_limit_error"
    assert int(refused["Retry-After"]) >= 1
    # reservations (4 + 5 each) were settled against the real usage, the same numbers as the usage rows
    assert quota_status(user).usage.tokens_today == 2 * (4 + 5)
    assert quota_status(user).usage.concurrent == 0
    rows = UsageRecord.objects.filter(user=user).order_by("created_at")
    assert [(r.status_code, r.prompt_tokens, r.completion_tokens) for r in rows] == [
        (200, 4, 5),
        (200, 4, 5),
        (429, 4, 0),
    ]


def test_an_omitted_max_tokens_stays_inside_the_plan_cap(api):
    _user, raw_key = api
    chat = Client().post(
        "/v1/chat/completions",
        {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "ignore_eos": True},
        content_type="application/json",
        HTTP_AUTHORIZATION=f"Bearer {raw_key}",
    )
    assert chat.status_code == 200  # chat's default is the rest of the context, capped by the plan
    assert chat.json()["usage"]["completion_tokens"] == PLAN["max_tokens_per_request"]
    completion = post(raw_key, ignore_eos=True)
    assert completion.status_code == 200  # /v1/completions defaults to 16, as OpenAI and vLLM do
    assert completion.json()["usage"]["completion_tokens"] == 16
    too_many = post(raw_key, max_tokens=65)
    assert too_many.status_code == 400 and too_many.json()["error"]["code"] == "max_tokens_exceeded"
