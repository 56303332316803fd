"""The engine worker's Redis protocol (docs/protocol.md) against a real redis-server and a tiny model."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest
import redis
from django.conf import settings

import inference.worker as worker_module
from engine_client import client as engine_client
from generation.services import collect
from inference import LLM, SamplingParams, protocol
from inference.output_processor import RequestState
from tests.inference.worker_helpers import (  # noqa: F401 (fixtures)
    ENGINE_ARGS,
    MODEL,
    ThreadedWorker,
    clear_engine_keys,
    llm,
    r,
    tiny_llm,
    wait_for,
    worker,
)

PROMPT = [5, 17, 42, 99, 7, 3]


@pytest.fixture(scope="module")
def second_llm(tiny_model_dir):
    return tiny_llm(tiny_model_dir)


def heartbeat_stats(worker_id: str) -> dict:
    raw = redis.Redis.from_url(settings.REDIS_URL).hget(protocol.heartbeat_key(worker_id), "stats")
    return json.loads(raw) if raw else {}


def offline_greedy(llm, max_tokens: int):
    return llm.generate(
        prompt_token_ids=[PROMPT],
        sampling_params=SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
        use_tqdm=False,
    )[0].outputs[0]


def served_events(llm, sampling_params: dict, **worker_config) -> tuple[str, list[dict]]:
    """PROMPT through a worker of its own: the request id and its events up to the terminal one."""
    running = ThreadedWorker(llm.llm_engine, settings.REDIS_URL, **worker_config).start()
    try:
        rid = engine_client.client().submit(model=MODEL, prompt_token_ids=PROMPT, sampling_params=sampling_params)
        return rid, list(engine_client.client().stream(rid, timeout=30))
    finally:
        running.stop()


def test_submit_streams_deltas_then_finish_equal_to_offline_greedy(llm, r):
    expected = offline_greedy(llm, 12)
    rid, events = served_events(llm, {"temperature": 0.0, "max_tokens": 12, "ignore_eos": True})
    deltas = [e for e in events if e["type"] == "delta"]
    assert len(deltas) >= 2, "tokens arrive step by step, not all at once"
    assert [t for d in deltas for t in d["token_ids"]] == expected.token_ids
    assert "".join(d["text"] for d in deltas) == expected.text
    finish = events[-1]
    assert finish["type"] == "finish" and finish["finish_reasons"] == ["length"]
    assert finish["usage"] == {"prompt_tokens": len(PROMPT), "completion_tokens": 12, "cached_tokens": 0}
    assert finish["metrics"]["ttft_ms"] is not None
    # the request is acknowledged: nothing is left pending in the group
    assert r.xpending(protocol.request_stream(MODEL), protocol.CONSUMER_GROUP)["pending"] == 0
    assert 0 < r.ttl(protocol.output_stream(rid)) <= 3600


def test_n2_with_logprobs_returns_two_choices_with_top_candidates(worker):
    rid = engine_client.client().submit(
        model=MODEL,
        prompt_token_ids=PROMPT,
        sampling_params={"n": 2, "temperature": 1.0, "seed": 7, "max_tokens": 6, "ignore_eos": True, "logprobs": 2},
    )
    result = collect(rid, n=2, timeout=30)
    assert result.error is None
    assert [c.index for c in result.choices] == [0, 1]
    for choice in result.choices:
        assert len(choice.token_ids) == 6 and choice.finish_reason == "length"
        assert len(choice.logprobs) == 6
        for entry, token_id in zip(choice.logprobs, choice.token_ids):
            assert entry["token_id"] == token_id and entry["logprob"] <= 0
            assert 1 <= len(entry["top"]) <= 2
    assert result.usage["completion_tokens"] == 12


def test_abort_mid_generation_frees_the_blocks(worker):
    rid = engine_client.client().submit(
        model=MODEL,
        prompt_token_ids=PROMPT * 4,
        sampling_params={"temperature": 0.0, "max_tokens": 200, "ignore_eos": True},
    )
    events = engine_client.client().stream(rid, timeout=30)
    first = next(events)
    assert first["type"] == "delta"
    wait_for(lambda: heartbeat_stats(worker.worker.worker_id).get("blocks_used", 0) > 0, timeout=5)
    engine_client.client().abort(rid)
    rest = list(events)
    assert rest[-1]["type"] == "finish" and rest[-1]["finish_reasons"] == ["abort"]
    assert rest[-1]["usage"]["completion_tokens"] < 200
    stats = wait_for(
        lambda: (
            (s := heartbeat_stats(worker.worker.worker_id))
            and s["blocks_used"] == 0
            and s["num_running"] == 0
            and s["inflight"] == 0
            and s
        )
    )
    assert stats["aborts_total"] >= 1


def test_a_request_aborted_before_any_worker_read_it_is_never_run(llm, r):
    rid = engine_client.client().submit(model=MODEL, prompt_token_ids=PROMPT, sampling_params={"max_tokens": 50})
    engine_client.client().abort(rid)
    running = ThreadedWorker(llm.llm_engine, settings.REDIS_URL).start()
    try:
        events = list(engine_client.client().stream(rid, timeout=30))
    finally:
        running.stop()
    assert [e["type"] for e in events] == ["finish"]
    assert events[0]["finish_reasons"] == ["abort"] and events[0]["usage"]["completion_tokens"] == 0


@pytest.mark.parametrize(
    "params, prompt, needle",
    [
        ({"temperature": -1.0}, PROMPT, "temperature"),
        ({"max_tokens": 4}, list(range(1, 300)), "max_model_len"),
        ({"no_such_field": 1}, PROMPT, "no_such_field"),
    ],
)
def test_invalid_requests_end_with_an_invalid_request_error(worker, params, prompt, needle):
    rid = engine_client.client().submit(model=MODEL, prompt_token_ids=prompt, sampling_params=params)
    events = list(engine_client.client().stream(rid, timeout=30))
    assert [e["type"] for e in events] == ["error"]
    assert events[0]["code"] == "invalid_request" and needle in events[0]["message"]


def test_an_expired_request_is_failed_not_run(llm, r):
    rid = engine_client.client().submit(
        model=MODEL, prompt_token_ids=PROMPT, sampling_params={"max_tokens": 4}, queue_timeout=0.01
    )
    time.sleep(0.05)
    running = ThreadedWorker(llm.llm_engine, settings.REDIS_URL).start()
    try:
        events = list(engine_client.client().stream(rid, timeout=30))
    finally:
        running.stop()
    assert events[-1]["type"] == "error" and events[-1]["code"] == "expired"


def test_priority_classes_reach_the_engine_in_order(llm, r):
    """Each request reaches engine.add_request with its class priority (interactive < api < batch)."""
    engine = llm.llm_engine
    order = []
    original = engine.add_request

    def spy(request_id, prompt, params, priority=0, **kw):
        order.append((request_id, priority))
        return original(request_id, prompt, params, priority=priority, **kw)

    batch = [
        engine_client.client().submit(
            model=MODEL,
            prompt_token_ids=PROMPT,
            sampling_params={"max_tokens": 3},
            priority_class="batch",
            request_id=f"b{i}",
        )
        for i in range(2)
    ]
    chat = engine_client.client().submit(
        model=MODEL,
        prompt_token_ids=PROMPT,
        sampling_params={"max_tokens": 3},
        priority_class="interactive",
        request_id="chat",
    )
    engine.add_request = spy
    running = ThreadedWorker(engine, settings.REDIS_URL).start()
    try:
        for rid in batch + [chat]:
            assert collect(rid, timeout=30).error is None
    finally:
        running.stop()
        del engine.add_request
    priorities = dict(order)
    assert priorities["chat"] < priorities["b0"] == priorities["b1"]
    assert priorities["chat"] == protocol.engine_priority("interactive") == 0
    assert priorities["b0"] == protocol.engine_priority("batch") == 2000


def test_heartbeat_publishes_stats_config_and_block_map(worker):
    info = wait_for(lambda: engine_client.client().workers())[0]
    assert info["worker_id"] == worker.worker.worker_id and info["model"] == "tiny"
    assert time.time() - info["updated_at"] < 2
    for key in (
        "num_running",
        "num_waiting",
        "kv_usage",
        "blocks_total",
        "blocks_used",
        "tokens_per_s",
        "inflight",
        "requests_total",
        "prefix_cache_hit_rate",
    ):
        assert key in info["stats"], key
    assert info["config"]["max_model_len"] == 256
    block_map = engine_client.client().block_maps()[worker.worker.worker_id]
    assert len(block_map["states"]) == info["stats"]["blocks_total"]
    ttl = redis.Redis.from_url(settings.REDIS_URL).pttl(protocol.heartbeat_key(worker.worker.worker_id))
    assert 0 < ttl <= 1000


def test_a_crashed_workers_request_ends_with_worker_lost_on_the_client(llm, r):
    crashing = ThreadedWorker(llm.llm_engine, settings.REDIS_URL).start()
    rid = engine_client.client().submit(
        model=MODEL,
        prompt_token_ids=PROMPT,
        sampling_params={"temperature": 0.0, "max_tokens": 200, "ignore_eos": True},
    )
    events = engine_client.client().stream(rid, timeout=30)
    assert next(events)["type"] == "delta"
    crashing.crash()
    started = time.monotonic()
    rest = list(events)
    assert rest[-1]["type"] == "error" and rest[-1]["code"] == "worker_lost"
    assert time.monotonic() - started < 1.0 + 1.0 + 1.5  # heartbeat TTL + one poll + slack
    assert r.exists(protocol.aborted_key(rid)), "the client also aborts, so no late worker runs it"


def test_a_surviving_worker_fails_the_dead_workers_requests(llm, second_llm, r):
    crashing = ThreadedWorker(llm.llm_engine, settings.REDIS_URL).start()
    rid = engine_client.client().submit(
        model=MODEL,
        prompt_token_ids=PROMPT,
        sampling_params={"temperature": 0.0, "max_tokens": 200, "ignore_eos": True},
    )
    wait_for(lambda: r.exists(protocol.output_stream(rid)))
    dead_id = crashing.worker.worker_id
    crashing.crash()
    survivor = ThreadedWorker(second_llm.llm_engine, settings.REDIS_URL).start()
    try:

        def reaped():
            entries = r.xrange(protocol.output_stream(rid))
            return any(
                e["type"] == "error" and e["code"] == "worker_lost"
                for _id, f in entries
                for e in json.loads(f[b"events"])
            )

        wait_for(reaped, timeout=10)
        assert r.xpending(protocol.request_stream(MODEL), protocol.CONSUMER_GROUP)["pending"] == 0
        stream = protocol.request_stream(MODEL)
        consumers = {c["name"].decode() for c in r.xinfo_consumers(stream, protocol.CONSUMER_GROUP)}
        assert dead_id not in consumers
    finally:
        survivor.stop()


def test_two_workers_share_one_consumer_group(llm, second_llm, r):
    workers = [ThreadedWorker(m.llm_engine, settings.REDIS_URL, max_inflight=2).start() for m in (llm, second_llm)]
    try:
        wait_for(lambda: len(engine_client.client().workers()) == 2)
        rids = [
            engine_client.client().submit(
                model=MODEL,
                prompt_token_ids=PROMPT,
                sampling_params={"temperature": 0.0, "max_tokens": 16, "ignore_eos": True},
            )
            for _ in range(8)
        ]
        claimed = {}
        for rid in rids:
            events = list(engine_client.client().stream(rid, timeout=60, include_control=True))
            assert events[-1]["type"] == "finish"
            claimed[rid] = events[0]["worker_id"]
    finally:
        for w in workers:
            w.stop()
    assert set(claimed.values()) == {w.worker.worker_id for w in workers}
    outputs = {tuple(collect(rid, timeout=5).choices[0].token_ids) for rid in rids}
    assert len(outputs) == 1, "greedy outputs agree whichever worker ran them"


def test_graceful_stop_drains_then_cleans_up(llm, r):
    running = ThreadedWorker(llm.llm_engine, settings.REDIS_URL).start()
    rid = engine_client.client().submit(
        model=MODEL, prompt_token_ids=PROMPT, sampling_params={"temperature": 0.0, "max_tokens": 20, "ignore_eos": True}
    )
    wait_for(lambda: r.exists(protocol.output_stream(rid)))
    running.worker.stop(drain=True)
    running.thread.join(30)
    result = collect(rid, timeout=5)
    assert result.error is None and len(result.choices[0].token_ids) == 20
    assert not r.exists(protocol.heartbeat_key(running.worker.worker_id))
    assert engine_client.client().health() == {"ok": False, "redis": True, "workers": []}


def test_no_worker_at_all_ends_the_stream_with_no_worker(r):
    rid = engine_client.client().submit(model=MODEL, prompt_token_ids=PROMPT, sampling_params={"max_tokens": 4})
    events = list(engine_client.client().stream(rid, no_worker_grace=0.5))
    assert events == [{"type": "error", "code": "no_worker", "message": "no engine worker is running"}]


def test_output_stream_ttl_is_set_at_accept_and_refreshed_only_when_due(llm, r):
    """Deltas skip EXPIRE while the stream's TTL is fresh (one Redis command per request per step)."""
    running = worker_module.EngineWorker(llm.llm_engine, r, worker_module.WorkerConfig(output_ttl=40))
    state = RequestState("ttl-test", "0-1", n=1)
    key = protocol.output_stream("ttl-test")

    def emit(events):
        pipe = r.pipeline(transaction=False)
        running._emit(pipe, "ttl-test", events, state)
        pipe.execute()

    emit([{"type": "accepted"}])
    assert 35 < r.ttl(key) <= 40
    r.expire(key, 20)  # as if time had passed
    emit([{"type": "delta", "index": 0, "text": "a", "token_ids": [1]}])
    assert r.ttl(key) <= 20, "a fresh TTL is not renewed on every delta"
    state.ttl_set_at -= 11  # more than a quarter of the TTL ago
    emit([{"type": "delta", "index": 0, "text": "b", "token_ids": [2]}])
    assert r.ttl(key) > 35
    r.expire(key, 20)
    emit([{"type": "finish"}])
    assert r.ttl(key) > 35, "the terminal event always sets the full TTL"
    r.delete(key)


def test_stream_interval_groups_tokens_but_sends_the_first_and_last_at_once(llm, r):
    expected = offline_greedy(llm, 11)
    _, events = served_events(llm, {"temperature": 0.0, "max_tokens": 11, "ignore_eos": True}, stream_interval=4)
    deltas = [e for e in events if e["type"] == "delta"]
    assert [len(d["token_ids"]) for d in deltas] == [1, 4, 4, 2]
    assert [t for d in deltas for t in d["token_ids"]] == expected.token_ids
    assert "".join(d["text"] for d in deltas) == expected.text
    assert events[-1]["type"] == "finish" and events[-1]["usage"]["completion_tokens"] == 11


def test_stream_interval_groups_each_choice_of_n2(llm, r):
    _, events = served_events(
        llm, {"n": 2, "temperature": 1.0, "seed": 3, "max_tokens": 11, "ignore_eos": True}, stream_interval=4
    )
    for index in (0, 1):
        sizes = [len(e["token_ids"]) for e in events if e["type"] == "delta" and e["index"] == index]
        assert sizes == [1, 4, 4, 2], (index, sizes)
    assert events[-1]["usage"]["completion_tokens"] == 22


def test_the_output_writer_keeps_the_order_it_was_given_and_stops_at_a_failed_write(r):
    """A step's pipeline goes out on the writer's thread while the next step runs: in the order sent,
    everything in Redis after flush(), and a failed write raised at the next send as a synchronous
    write would have."""
    writer = worker_module.OutputWriter()
    key = protocol.output_stream("writer-order-test")
    try:
        for i in range(200):
            pipe = r.pipeline(transaction=False)
            pipe.xadd(key, {"i": i})
            writer.send(pipe)
        writer.flush()
        assert [int(fields[b"i"]) for _, fields in r.xrange(key)] == list(range(200))

        r.set("writer-order-test-string", "x")
        broken = r.pipeline(transaction=False)
        broken.xadd("writer-order-test-string", {"i": 0})  # WRONGTYPE: the write fails in Redis
        writer.send(broken)
        with pytest.raises(redis.RedisError):
            writer.flush()
        with pytest.raises(redis.RedisError):
            writer.send(r.pipeline(transaction=False))
    finally:
        r.delete(key, "writer-order-test-string")


@pytest.mark.parametrize("policy, batches", [("fcfs", 2), ("priority", 2), ("fair", 8)])
def test_a_fair_worker_reads_more_of_the_backlog_by_default(tiny_model_dir, policy, batches):
    """Fair share orders only what a worker has read; the rest waits in the stream first come, first served."""
    engine = LLM(model=tiny_model_dir, **{**ENGINE_ARGS, "scheduling_policy": policy}).llm_engine
    worker = worker_module.EngineWorker(engine, redis.Redis.from_url(settings.REDIS_URL), worker_module.WorkerConfig())
    assert worker.max_inflight == batches * ENGINE_ARGS["max_num_seqs"]


FREEZE_CHECK = """
import gc, sys
import redis
from inference.worker import EngineWorker, WorkerConfig
from tests.inference.worker_helpers import tiny_llm

model_dir, redis_url, freeze = sys.argv[1:]
config = WorkerConfig(model_name="freeze-check", freeze_heap=freeze == "1")
worker = EngineWorker(tiny_llm(model_dir).llm_engine, redis.Redis.from_url(redis_url), config)
worker.setup()
print(gc.get_freeze_count())
worker.shutdown()
"""


@pytest.mark.parametrize("freeze", [True, False])
def test_a_worker_in_its_own_process_freezes_what_start_up_allocated(tiny_model_dir, r, freeze):
    """manage.py engine asks for it (test_engine_command); a worker in a test's own process must not."""
    args = [sys.executable, "-c", FREEZE_CHECK, tiny_model_dir, settings.REDIS_URL, "1" if freeze else "0"]
    done = subprocess.run(args, capture_output=True, text=True, timeout=300, cwd=settings.REPO_DIR)
    assert done.returncode == 0, done.stderr
    frozen = int(done.stdout.split()[-1])
    assert frozen > 10_000 if freeze else frozen == 0  # torch and the model's modules, or nothing
