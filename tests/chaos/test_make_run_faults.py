"""Faults injected into `make run` (python -m tessera.run on loopback, tiny model): a process is
killed with SIGKILL and its supervisor must bring it back while clients get clear errors, never a
hang, and nothing accepted is lost. One stack serves the module's scenarios in turn, so each also
shows that the stack survived the ones before it."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
import redis

from inference import protocol as redis_keys
from tests.chaos.clients import (
    FINAL_BATCH_STATUSES,
    batch_lines,
    check_exactly_once,
    create_batch,
    openai_client,
    sse_stream,
    wait_for_batch,
    ws_chat,
)
from tests.platform.run_stack import WEB_PROCESS, RunStack, make_run_env

pytestmark = [pytest.mark.chaos, pytest.mark.slow]

N_SSE = 3
CONCURRENCY = N_SSE + 1  # the plan's concurrent-request limit: exactly the streams of the engine scenario
ENGINE_ARGS = {"num_kv_blocks": 512, "max_model_len": 1024, "max_num_seqs": 16, "device": "cpu"}
ENV = {
    "ENGINE_ARGS": json.dumps(ENGINE_ARGS),
    "CELERY_CONCURRENCY": "2",
    "QUOTA_CONCURRENT_REQUESTS": str(CONCURRENCY),
    "QUOTA_REQUESTS_PER_MINUTE": "100000",
    "QUOTA_TOKENS_PER_DAY": "100000000",
    "QUOTA_TOKENS_PER_MONTH": "1000000000",
    # A dead Celery worker's batch lease lapses in seconds, and the watchdog looks every second.
    "BATCH_LEASE_SECONDS": "4",
    "BATCH_WATCHDOG_INTERVAL": "1",
    "BATCH_MAX_IN_FLIGHT": "4",
    "BATCH_PROGRESS_INTERVAL": "0.2",
}


@pytest.fixture(scope="module")
def stack(tiny_model_dir, tmp_path_factory):
    work = tmp_path_factory.mktemp("chaos-make-run")
    running = RunStack.start(make_run_env(tiny_model_dir, work / "var", **ENV), work / "make-run.log")
    try:
        yield running
    finally:
        running.close()


@pytest.fixture(scope="module")
def login(stack):
    password, api_key = stack.admin_login()
    model = openai_client(stack.base_url, api_key).models.list().data[0].id
    return {"password": password, "api_key": api_key, "model": model}


def serving_again(stack, login, timeout: float = 180) -> float:
    """time.monotonic() of the first completion that succeeds (retrying while the stack recovers)."""
    client = openai_client(stack.base_url, login["api_key"], timeout=30)
    deadline = time.monotonic() + timeout
    while True:
        try:
            client.chat.completions.create(
                model=login["model"], max_tokens=2, messages=[{"role": "user", "content": "Hello"}]
            )
            return time.monotonic()
        except openai.APIError:
            assert time.monotonic() < deadline, stack.output()[-4000:]
            time.sleep(0.2)


@pytest.mark.chaos_fast  # also in `make test`: one stack start and one kill, about 30 s
def test_engine_worker_kill_with_streams_in_flight(stack, login, chaos_report):
    """engine worker `kill -9` with 3 SSE streams and 1 websocket answer in flight"""
    clients = [sse_stream(stack.base_url, login["api_key"], login["model"], 900) for _ in range(N_SSE)]
    clients.append(ws_chat(stack.base_url, "admin", login["password"], 800))
    for client in clients:
        assert client.started.wait(60), (client.ended, client.detail)
    engine = stack.pid("manage.py engine")
    mark = stack.mark()
    os.kill(engine, signal.SIGSTOP)  # frozen first, so no answer can finish before the kill
    assert not [c for c in clients if c.done.is_set()], [(c.ended, c.detail) for c in clients]
    killed_at = time.monotonic()
    os.kill(engine, signal.SIGKILL)

    for client in clients:
        assert client.done.wait(30), f"a {client.kind} client still waits 30 s after the kill"
    assert [c.ended for c in clients] == ["error"] * len(clients), [(c.ended, c.detail) for c in clients]
    waits = [c.at - killed_at for c in clients]
    assert max(waits) < 5.0, waits
    # Every reservation of the failed answers is released (the quota ledger's concurrency sets
    # empty), well before the 120 s lease would free a slot on its own.
    r = redis.Redis.from_url(stack.redis_url())
    deadline = time.monotonic() + 30
    while held := {key: r.zrange(key, 0, -1) for key in r.scan_iter(match="*:conc") if r.zcard(key)}:
        assert time.monotonic() < deadline, (
            "reservations still held",
            held,
            [r.hgetall(f"quota:res:{rid.decode()}") for rids in held.values() for rid in rids],
        )
        time.sleep(0.1)
    released_at = time.monotonic()

    stack.wait_for(r"^engine was killed by signal 9; restarting it in \d+s$", timeout=30, since=mark)
    stack.wait_for(r"^engine restarted \(restart \d+\)$", timeout=60, since=mark)
    back_at = serving_again(stack, login)
    # The whole concurrency limit is free again for new requests.
    client = openai_client(stack.base_url, login["api_key"])
    with ThreadPoolExecutor(CONCURRENCY) as pool:
        replies = list(
            pool.map(
                lambda _: client.chat.completions.create(
                    model=login["model"],
                    max_tokens=32,
                    messages=[{"role": "user", "content": "Hi"}],
                    extra_body={"ignore_eos": True},
                ),
                range(CONCURRENCY),
            )
        )
    assert [r.usage.completion_tokens for r in replies] == [32] * CONCURRENCY
    chaos_report(
        "every SSE and websocket client got an error event; the supervisor restarted the engine; "
        f"all {CONCURRENCY} concurrency slots free again",
        f"error events {min(waits):.2f}-{max(waits):.2f} s after the kill; reservations released after "
        f"{released_at - killed_at:.1f} s; serving again after {back_at - killed_at:.1f} s",
    )


def test_celery_worker_kill_mid_batch(stack, login, chaos_report):
    """Celery worker `kill -9` mid-batch (32 lines)"""
    client = openai_client(stack.base_url, login["api_key"])
    lines = batch_lines(login["model"], 32)
    batch = create_batch(client, lines)
    wait_for_batch(
        client, batch.id, lambda b: b.request_counts.completed >= 4, 180, detail=lambda: stack.output()[-4000:]
    )
    mark = stack.mark()
    killed_at = time.monotonic()
    os.kill(stack.pid("tessera worker"), signal.SIGKILL)
    at_kill = client.batches.retrieve(batch.id)
    assert at_kill.status == "in_progress" and at_kill.request_counts.completed < len(lines)
    stack.wait_for(r"^worker restarted \(restart \d+\)$", timeout=60, since=mark)

    final = wait_for_batch(
        client, batch.id, lambda b: b.status in FINAL_BATCH_STATUSES, 300, detail=lambda: stack.output()[-4000:]
    )
    done_at = time.monotonic()
    check_exactly_once(client, final, lines)
    chaos_report(
        "the supervisor restarted the worker; every custom_id exactly once, request_counts exact",
        f"{at_kill.request_counts.completed}/32 done at the kill; 32/32 completed, 0 failed, "
        f"{done_at - killed_at:.1f} s after the kill",
    )


def test_redis_kill_under_load(stack, login, chaos_report):
    """embedded Redis `kill -9` under load (2 clients in a loop)"""
    results: list[tuple[float, int, bool, float]] = []  # (ended at, status or 0 on timeout, envelope?, seconds)
    stop = threading.Event()

    def load():
        with httpx.Client(
            base_url=stack.base_url, timeout=20, headers={"Authorization": f"Bearer {login['api_key']}"}
        ) as http:
            while not stop.is_set():
                started = time.monotonic()
                try:
                    response = http.post(
                        "/v1/chat/completions",
                        json={
                            "model": login["model"],
                            "max_tokens": 4,
                            "messages": [{"role": "user", "content": "Hi"}],
                        },
                    )
                    status, envelope = response.status_code, _is_envelope(response)
                except httpx.TimeoutException:
                    status, envelope = 0, False
                except httpx.TransportError:
                    status, envelope = -1, False
                results.append((time.monotonic(), status, envelope, time.monotonic() - started))
                if status != 200:
                    stop.wait(0.05)  # a client backs off a little on an error

    threads = [threading.Thread(target=load, daemon=True) for _ in range(2)]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + 60
    while sum(1 for r in results if r[1] == 200) < 4:
        assert time.monotonic() < deadline, results[-5:]
        time.sleep(0.1)
    web = stack.pid(WEB_PROCESS)
    mark = stack.mark()
    killed_at = time.monotonic()
    os.kill(stack.pid("redis-server"), signal.SIGKILL)
    stack.wait_for(r"^redis restarted \(restart \d+\)$", timeout=60, since=mark)
    deadline = time.monotonic() + 120
    while not [r for r in results if r[0] > killed_at and r[1] == 200]:
        assert time.monotonic() < deadline, (results[-5:], stack.output()[-3000:])
        time.sleep(0.1)
    recovered_at = min(r[0] for r in results if r[0] > killed_at and r[1] == 200)
    time.sleep(2)  # load keeps running on the recovered stack
    stop.set()
    for thread in threads:
        thread.join(30)

    after = [r for r in results if r[0] > killed_at]
    statuses = Counter(status for _, status, _, _ in after)
    # No 500, no timeout (0), no cut connection (-1).
    assert set(statuses) <= {200, 429, 503}, statuses
    assert all(envelope for _, status, envelope, _ in after if status != 200)
    assert stack.pid(WEB_PROCESS) == web, "the web tier was restarted"
    r = redis.Redis.from_url(stack.redis_url())
    assert r.ping()
    # Settlements that failed during the outage were applied once Redis answered (before the next
    # admission): no concurrency slot waits for its 120 s lease.
    deadline = time.monotonic() + 10
    while held := {key: r.zrange(key, 0, -1) for key in r.scan_iter(match="*:conc") if r.zcard(key)}:
        assert time.monotonic() < deadline, ("reservations still held after the outage", held)
        time.sleep(0.1)
    chaos_report(
        "the web tier answered 503 in the envelope (no 500, no hang) and recovered without a restart; "
        "the supervisor restarted Redis",
        f"{statuses[503]} x 503, {statuses[429]} x 429, {statuses[200]} x 200, 0 x 500; slowest answer "
        f"{max(r[3] for r in after):.2f} s; serving again {recovered_at - killed_at:.1f} s after the kill",
    )


def _is_envelope(response: httpx.Response) -> bool:
    try:
        error = response.json().get("error")
    except ValueError:
        return False
    return isinstance(error, dict) and {"message", "type", "param", "code"} <= set(error)


def test_web_kill_mid_stream(stack, login, chaos_report):
    """web process (uvicorn) `kill -9` mid-stream"""
    r = redis.Redis.from_url(stack.redis_url())
    before = set(r.scan_iter(match=redis_keys.output_stream("*")))
    stream = sse_stream(stack.base_url, login["api_key"], login["model"], 900)
    assert stream.started.wait(60), (stream.ended, stream.detail)
    [key] = set(r.scan_iter(match=redis_keys.output_stream("*"))) - before
    leases = set(r.scan_iter(match=redis_keys.lease_key("*")))
    assert leases, "the web process holds a lease while it streams"
    mark = stack.mark()
    # The engine is frozen until the dead web's lease has lapsed, so the request cannot reach its
    # max_tokens first however fast the engine runs (the tiny model makes 900 tokens in about 2 s).
    # Thawed, the worker's loop checks leases at once (a heartbeat has passed) and aborts it.
    engine = stack.pid("manage.py engine")
    os.kill(engine, signal.SIGSTOP)
    try:
        killed_at = time.monotonic()
        os.kill(stack.pid(WEB_PROCESS), signal.SIGKILL)
        assert stream.done.wait(10) and stream.ended == "cut"
        lapse_by = killed_at + redis_keys.LEASE_TTL_S + 2.0
        while any(r.exists(lease) for lease in leases) and time.monotonic() < lapse_by:
            time.sleep(0.05)
    finally:
        os.kill(engine, signal.SIGCONT)
    deadline = time.monotonic() + 3.0  # one loop turn and the step in flight
    while not (terminal := _terminal_event(r, key)) and time.monotonic() < deadline:
        time.sleep(0.05)
    ended_at, entries_at_deadline = time.monotonic(), r.xlen(key)
    stack.wait_for(r"^web restarted \(restart \d+\)$", timeout=60, since=mark)
    back_at = serving_again(stack, login)
    aborted = terminal is not None and terminal.get("finish_reasons") == ["abort"]
    chaos_report(
        "the supervisor restarted the web"
        + (
            "; the engine aborted the orphaned request"
            if aborted
            else "; the engine did NOT abort the orphaned request (it runs to max_tokens)"
        ),
        f"web serving again {back_at - killed_at:.1f} s after the kill; "
        + (
            f"aborted within {ended_at - killed_at:.2f} s"
            if aborted
            else f"{entries_at_deadline} output entries {deadline - killed_at:.0f} s after the kill, still running"
        ),
    )
    assert aborted, (terminal, entries_at_deadline, _worker_stats(r))


def _worker_stats(r: redis.Redis) -> list[dict]:
    stats = [r.hget(redis_keys.heartbeat_key(w.decode()), "stats") for w in r.smembers(redis_keys.WORKERS_SET)]
    return [json.loads(raw) for raw in stats if raw]


def _terminal_event(r: redis.Redis, key: bytes) -> dict | None:
    for _, fields in r.xrange(key):
        for event in redis_keys.decode(fields[b"events"]):
            if event["type"] in redis_keys.TERMINAL_EVENTS:
                return event
    return None
