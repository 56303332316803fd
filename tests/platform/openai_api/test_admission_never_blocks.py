"""Admission never waits on one request's work: a prompt that cannot fit is refused before it is
tokenized, and a large body is admitted on a thread of its own, never in front of small requests."""

from __future__ import annotations

import asyncio
import threading
import uuid

import httpx
import pytest
from django.contrib.auth.models import User
from django.test import Client

from accounts.services import create_api_key
from generation import services as generation
from generation import tokenization
from openai_api.views import LARGE_BODY_BYTES
from tests.inference.worker_helpers import llm, serving_worker  # noqa: F401 (the llm fixture)

pytestmark = pytest.mark.django_db(transaction=True)
MAX_MODEL_LEN = 256


@pytest.fixture
def raw_key(llm, settings):
    settings.QUOTA_REDIS_PREFIX = f"qadm-{uuid.uuid4().hex[:8]}"
    settings.SERVED_MODEL_NAME = "tiny"
    worker = serving_worker(llm, "tiny", max_model_len=MAX_MODEL_LEN)
    user = User.objects.create_user("flooder", password="pw-long-enough")
    yield create_api_key(user)[1]
    worker.stop()


def _complete(raw_key, prompt, **body):
    return Client().post(
        "/v1/completions",
        {"model": "tiny", "prompt": prompt, "max_tokens": 2, **body},
        content_type="application/json",
        HTTP_AUTHORIZATION=f"Bearer {raw_key}",
    )


def test_a_prompt_that_cannot_fit_is_refused_without_tokenizing_it(raw_key, monkeypatch):
    path = tokenizer_path()
    longest = tokenization.longest_token_chars(path)
    tokenized = []
    real = tokenization.text_prompt_ids
    monkeypatch.setattr(tokenization, "text_prompt_ids", lambda p, text: tokenized.append(len(text)) or real(p, text))
    huge = "x" * (longest * MAX_MODEL_LEN)  # at least MAX_MODEL_LEN tokens, whatever the tokenizer does
    refused = _complete(raw_key, huge)
    assert refused.status_code == 400 and refused.json()["error"]["code"] == "context_length_exceeded"
    assert refused.json()["error"]["param"] == "prompt" and tokenized == []
    chat = Client().post(
        "/v1/chat/completions",
        {"model": "tiny", "messages": [{"role": "user", "content": huge}]},
        content_type="application/json",
        HTTP_AUTHORIZATION=f"Bearer {raw_key}",
    )
    assert chat.status_code == 400 and chat.json()["error"]["param"] == "messages"
    fits = _complete(raw_key, "hello")  # the check is a bound, never a guess: a short prompt still runs
    assert fits.status_code == 200 and tokenized == [5]


def tokenizer_path() -> str:
    from generation import catalog

    return catalog.resolve_model("tiny")["model_path"]


def test_a_large_body_waits_on_its_own_thread_while_small_requests_are_admitted(raw_key):
    """Hold the large-admission thread busy: a small request still completes, a large one waits."""
    asyncio.run(_large_and_small(raw_key))


async def _large_and_small(raw_key):
    held, release = threading.Event(), threading.Event()

    def hold():
        held.set()
        release.wait(60)

    holding = asyncio.ensure_future(generation.on_bookkeeping_thread(hold, large=True))
    await asyncio.to_thread(held.wait, 10)
    # The API's own ASGI handler, as the web server runs it (the test client's stack adds browser middleware
    # that serializes requests on one thread).
    from tessera.asgi import api_asgi_app

    client = httpx.AsyncClient(
        transport=httpx.ASGITransport(app=api_asgi_app),
        base_url="http://testserver",
        headers={"Authorization": f"Bearer {raw_key}"},
        timeout=60,
    )
    large_prompt = "hello " * (LARGE_BODY_BYTES // 6 + 1)  # over the size, and refused once admitted
    large = asyncio.ensure_future(
        client.post("/v1/completions", json={"model": "tiny", "prompt": large_prompt, "max_tokens": 2})
    )
    small = await client.post("/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 2})
    assert small.status_code == 200, small.content
    assert not large.done(), "the large request was admitted while its thread was held"
    release.set()
    await holding
    answered = await large
    await client.aclose()
    assert answered.status_code == 400 and answered.json()["error"]["code"] == "context_length_exceeded"
