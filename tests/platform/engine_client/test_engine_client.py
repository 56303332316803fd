"""The engine client's own behaviour: request building, async streaming, resume, liveness, health."""

from __future__ import annotations

import asyncio

import pytest
import redis

from engine_client import client as engine
from inference import protocol
from tests.inference.worker_helpers import MODEL, ThreadedWorker, clear_engine_keys, llm, r, tiny_llm, wait_for, worker  # noqa: F401 (fixtures)

PROMPT = [5, 17, 42, 99, 7, 3]


@pytest.mark.parametrize(
    "cls, within, expected",
    [("interactive", 0, 0), ("interactive", 5, 5), ("api", 0, 1000), ("api", 5000, 1999), ("batch", -3, 2000)],
)
def test_priority_classes_map_onto_disjoint_engine_priority_ranges(cls, within, expected):
    assert protocol.engine_priority(cls, within) == expected


def test_bad_submissions_are_refused_before_anything_is_queued(r):
    with pytest.raises(ValueError):
        engine.client().submit(model=MODEL, prompt_token_ids=PROMPT, prompt="both", sampling_params={})
    with pytest.raises(ValueError):
        engine.client().submit(model=MODEL, sampling_params={})
    with pytest.raises(ValueError):
        engine.client().submit(model=MODEL, prompt_token_ids=PROMPT, priority_class="vip")
    with pytest.raises(ValueError, match="model"):
        engine.client().submit(model="", prompt_token_ids=PROMPT)
    assert r.xlen(protocol.request_stream(MODEL)) == 0 if r.exists(protocol.request_stream(MODEL)) else True


def test_submit_writes_the_documented_message(r):
    rid = engine.client().submit(
        model=MODEL,
        prompt_token_ids=PROMPT,
        sampling_params={"max_tokens": 3},
        priority_class="batch",
        priority=7,
        user=42,
        queue_timeout=60,
    )
    [(_id, fields)] = r.xrange(protocol.request_stream(MODEL))
    message = protocol.decode(fields[b"data"])
    assert message["request_id"] == rid and message["prompt_token_ids"] == PROMPT and message["prompt"] is None
    assert message["priority"] == 2007 and message["priority_class"] == "batch" and message["user"] == "42"
    assert message["model"] == MODEL
    assert message["deadline"] - message["submitted_at"] == pytest.approx(60)


def test_astream_yields_what_stream_yields(worker):
    params = {"temperature": 0.0, "max_tokens": 8, "ignore_eos": True}
    sync_rid = engine.client().submit(model=MODEL, prompt_token_ids=PROMPT, sampling_params=params)
    sync_events = list(engine.client().stream(sync_rid, model=MODEL, timeout=30))

    async def run():
        client = engine.aclient()
        rid = engine.client().submit(
            model=MODEL, prompt_token_ids=PROMPT, sampling_params=params, lease_id=client.lease()
        )
        return [e async for e in client.stream(rid, model=MODEL, timeout=30)]

    async_events = asyncio.run(run())
    strip = lambda events: [{k: v for k, v in e.items() if k not in ("entry_id", "metrics")} for e in events]  # noqa: E731
    assert strip(async_events) == strip(sync_events)


def test_stream_resumes_after_an_entry_id_and_replays_from_the_start(worker):
    rid = engine.client().submit(
        model=MODEL, prompt_token_ids=PROMPT, sampling_params={"temperature": 0.0, "max_tokens": 6, "ignore_eos": True}
    )
    events = list(engine.client().stream(rid, timeout=30))
    assert list(engine.client().stream(rid, timeout=5)) == events, "a reconnecting reader sees everything again"
    resumed = list(engine.client().stream(rid, last_id=events[0]["entry_id"], timeout=5))
    assert resumed == [e for e in events if e["entry_id"] > events[0]["entry_id"]] or resumed == events[1:]


def test_timeout_ends_the_stream_with_an_error_and_aborts(r):
    rid = engine.client().submit(model=MODEL, prompt_token_ids=PROMPT, sampling_params={"max_tokens": 4})
    events = list(engine.client().stream(rid, timeout=0.5, no_worker_grace=60))
    assert [(e["type"], e["code"]) for e in events] == [("error", "timeout")]
    assert r.exists(protocol.aborted_key(rid)), "a worker that starts later must not run it"


def test_health_tracks_heartbeats_and_forgets_dead_workers(worker, r):
    assert engine.client().health() == {"ok": True, "redis": True, "workers": [worker.worker.worker_id]}
    worker.crash()
    wait_for(lambda: not engine.client().health()["ok"], timeout=5)
    assert not r.sismember(protocol.WORKERS_SET, worker.worker.worker_id)

    async def ahealth():
        return await engine.aclient().health()

    assert asyncio.run(ahealth())["ok"] is False


def test_health_reports_an_unreachable_redis():
    state = engine.EngineClient(redis.Redis(port=1, socket_connect_timeout=0.2)).health()
    assert state["ok"] is False and state["redis"] is False
