"""Tenant and weight over the protocol: the worker hands them to the engine; a bad weight is an
invalid_request error for that request alone, and the heartbeat shows each tenant's share."""

from __future__ import annotations

import json

import redis
from django.conf import settings

from engine_client import client as engine_client
from inference import protocol
from tests.inference.worker_helpers import MODEL, clear_engine_keys, llm, r, tiny_llm, wait_for, worker  # noqa: F401

PROMPT = [5, 17, 42, 99, 7, 3]


def run(tenant, weight, max_tokens=3):
    rid = engine_client.client().submit(
        model=MODEL,
        prompt_token_ids=PROMPT,
        tenant=tenant,
        weight=weight,
        sampling_params={"max_tokens": max_tokens, "ignore_eos": True},
    )
    return list(engine_client.client().stream(rid, timeout=30))


def test_a_tenants_service_shows_in_the_heartbeat(worker):
    events = run("42", 2.0)
    assert events[-1]["type"] == "finish" and events[-1]["usage"]["completion_tokens"] == 3

    def shares():
        raw = redis.Redis.from_url(settings.REDIS_URL).hget(protocol.heartbeat_key(worker.worker.worker_id), "stats")
        rows = json.loads(raw)["tenant_shares"]["tenants"] if raw else []
        return [row for row in rows if row["tenant"] == "42"]

    wait_for(shares, timeout=10)
    assert shares()[0]["weight"] == 2.0 and shares()[0]["tokens"] == len(PROMPT) + 2 * 3


def test_a_bad_weight_fails_that_request_alone(worker):
    for bad in (0, -1, "heavy"):
        events = run("7", bad)
        assert [e["type"] for e in events] == ["error"]
        assert events[0]["code"] == "invalid_request" and "weight must be a positive number" in events[0]["message"]
    assert run("7", 1.0)[-1]["type"] == "finish"


def test_a_request_without_a_tenant_behaves_as_before(worker):
    rid = engine_client.client().submit(model=MODEL, prompt_token_ids=PROMPT, sampling_params={"max_tokens": 2})
    assert list(engine_client.client().stream(rid, timeout=30))[-1]["type"] == "finish"


def test_prometheus_shows_a_bounded_tenant_share_view():
    from prometheus_client import CollectorRegistry, generate_latest

    from openai_api.metrics import HeartbeatCollector

    rows = [{"tenant": str(i), "tokens": 10 * (9 - i), "share": 0.1, "weight": 1.0 + i} for i in range(5)]
    stats = {
        "tenant_shares": {
            "window_s": 60,
            "total_tokens": 500,
            "tenants": rows,
            "others": {"tenants": 40, "tokens": 150, "share": 0.3},
        }
    }
    registry = CollectorRegistry()
    registry.register(HeartbeatCollector([{"worker_id": "w1", "model": "m", "stats": stats}]))
    text = generate_latest(registry).decode()
    share_lines = [line for line in text.splitlines() if line.startswith("tessera_engine_tenant_share{")]
    assert len(share_lines) == 6  # five tenants and "others", not 45 series
    assert 'tessera_engine_tenant_share{model="m",tenant="others",worker="w1"} 0.3' in text
    assert 'tessera_engine_tenant_weight{model="m",tenant="4",worker="w1"} 5.0' in text
