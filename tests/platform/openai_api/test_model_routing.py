"""Requests are routed by model: two workers serving two different tiny models at once, one with an alias.

In-process /v1 (Django test client) against two engine worker threads on the test Redis. Each
answer must be its own model's offline greedy output, claimed by the worker serving that name;
a name no live worker serves is a 404, never another model's answer.
"""

from __future__ import annotations

import json

import pytest
import redis
from django.conf import settings
from django.contrib.auth.models import User
from django.test import Client

from accounts.services import create_api_key
from engine_client import client as engine
from inference import SamplingParams, protocol
from tests.inference.worker_helpers import ThreadedWorker, clear_engine_keys, tiny_llm, wait_for
from usage.models import UsageRecord

pytestmark = pytest.mark.django_db(transaction=True)
PROMPT = [5, 6, 7, 8]
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def llms(tiny_model_dir, model_factory):
    return {"tiny-a": tiny_llm(tiny_model_dir), "tiny-b": tiny_llm(model_factory("qwen2"))}


@pytest.fixture(scope="module")
def expected(llms):
    """Each model's own offline greedy answer (computed before any worker thread steps its engine)."""
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return {
        name: llm.generate(prompt_token_ids=[PROMPT], sampling_params=params, use_tqdm=False)[0].outputs[0]
        for name, llm in llms.items()
    }


def _worker(llm, name: str, **config) -> ThreadedWorker:
    info = {"max_model_len": llm.llm_engine.max_model_len, "model_path": llm.llm_engine.args.model}
    return ThreadedWorker(llm.llm_engine, settings.REDIS_URL, model_name=name, extra_info=info, **config).start()


@pytest.fixture
def two_models(llms, expected, settings):
    settings.QUOTA_DEFAULT_PLAN = {
        "tokens_per_day": 10**8,
        "tokens_per_month": 10**9,
        "requests_per_minute": 10**5,
        "concurrent_requests": 100,
        "max_tokens_per_request": 1000,
    }
    r = redis.Redis.from_url(settings.REDIS_URL)
    clear_engine_keys(r)
    workers = {
        "tiny-a": _worker(llms["tiny-a"], "tiny-a", aliases=("tiny-a-alias",)),
        "tiny-b": _worker(llms["tiny-b"], "tiny-b"),
    }
    wait_for(lambda: all(r.exists(protocol.heartbeat_key(w.worker.worker_id)) for w in workers.values()))
    user = User.objects.create_user("router", password="pw-long-enough")
    yield workers, create_api_key(user)[1], r
    for worker in workers.values():
        worker.stop()
    clear_engine_keys(r)


def _complete(raw_key: str, model: str):
    body = {"model": model, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
    return Client().post(
        "/v1/completions", body, content_type="application/json", HTTP_AUTHORIZATION=f"Bearer {raw_key}"
    )


def _claimed_by(r, request_id: str) -> str:
    [(_id, fields)] = r.xrange(protocol.output_stream(request_id), count=1)
    [accepted] = [e for e in json.loads(fields[b"events"]) if e["type"] == "accepted"]
    return accepted["worker_id"]


def test_each_model_answers_only_its_own_requests_and_aliases_reach_their_model(expected, two_models):
    workers, raw_key, r = two_models
    assert expected["tiny-a"].token_ids != expected["tiny-b"].token_ids, (
        "the two tiny models must disagree for this test to mean anything"
    )
    listed = Client().get("/v1/models", HTTP_AUTHORIZATION=f"Bearer {raw_key}").json()
    assert sorted(m["id"] for m in listed["data"]) == ["tiny-a", "tiny-a-alias", "tiny-b"]

    routes = [("tiny-a", "tiny-a"), ("tiny-b", "tiny-b"), ("tiny-a-alias", "tiny-a"), ("tiny-b", "tiny-b")]
    for asked, served_by in routes:
        response = _complete(raw_key, asked)
        assert response.status_code == 200, response.content
        body = response.json()
        assert body["model"] == asked
        assert _claimed_by(r, body["id"]) == workers[served_by].worker.worker_id
        assert body["choices"][0]["text"] == expected[served_by].text, asked
    rows = UsageRecord.objects.order_by("created_at")
    assert [(r.model, r.completion_tokens) for r in rows] == [
        ("tiny-a", MAX_TOKENS),
        ("tiny-b", MAX_TOKENS),
        ("tiny-a-alias", MAX_TOKENS),
        ("tiny-b", MAX_TOKENS),
    ]
    # both TTFTs are stored: from the HTTP request's arrival, and from the worker's acceptance (inside it)
    assert all(0 < r.engine_ttft_ms <= r.ttft_ms for r in rows), [(r.engine_ttft_ms, r.ttft_ms) for r in rows]


def test_a_model_no_live_worker_serves_is_a_404_never_another_models_answer(two_models):
    workers, raw_key, r = two_models
    unknown = _complete(raw_key, "tiny-c")
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "model_not_found"
    workers["tiny-b"].stop()
    wait_for(lambda: not r.exists(protocol.heartbeat_key(workers["tiny-b"].worker.worker_id)))
    engine.client().forget_workers_snapshot()  # /v1 may trust a 1 s old worker list; this test is faster
    gone = _complete(raw_key, "tiny-b")
    assert gone.status_code == 404 and gone.json()["error"]["code"] == "model_not_found"
    assert gone.json()["error"]["param"] == "model"
    retrieve = Client().get("/v1/models/tiny-b", HTTP_AUTHORIZATION=f"Bearer {raw_key}")
    assert retrieve.status_code == 404
    assert _complete(raw_key, "tiny-a").status_code == 200, "the other model is still served"
    assert not r.exists(protocol.request_stream("tiny-c")), "nothing was queued for a model nobody serves"
