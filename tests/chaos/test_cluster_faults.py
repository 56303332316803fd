"""Faults between hosts of `make cluster` (deploy/cluster.py: five network namespaces on veth links,
PostgreSQL and Redis on one of them, a tiny model in the two engine workers): partitions (nftables in
the host's namespace), latency and loss (tc netem where the kernel has it, else loss alone from
nftables), and a PostgreSQL restart. One cluster serves the module's scenarios in turn.
Needs root (ip netns); only this machine's own namespaces are touched."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import psycopg
import pytest
import redis

from deploy import cluster as netns
from inference import protocol as redis_keys
from tests.chaos.clients import completion_body, completion_streams, quantile, sse_stream

pytestmark = [
    pytest.mark.chaos,
    pytest.mark.slow,
    pytest.mark.skipif(os.geteuid() != 0, reason="network namespaces need root"),
]

ENGINE_ARGS = {
    "dtype": "float32",
    "device": "cpu",
    "block_size": 16,
    "max_num_seqs": 128,
    "max_num_batched_tokens": 2048,
    "max_model_len": 1024,
    "num_kv_blocks": 1024,
    "seed": 0,
}
UNLIMITED_PLAN = (
    "from django.contrib.auth import get_user_model; from quotas.models import Plan, UserPlan; "
    "UserPlan.objects.create(user=get_user_model().objects.get(username='admin'), "
    "plan=Plan.objects.create(name='chaos'))"
)  # blank limits: unlimited
PROMPT = "The tiles of the old house"


@pytest.fixture(scope="module")
def cluster(tiny_model_dir, tmp_path_factory):
    work = Path("/tmp") / f"tessera-chaos-cluster-{os.getpid()}"  # PostgreSQL's user must reach it
    work.mkdir(mode=0o755)
    running = netns.Cluster(work_dir=work, model=tiny_model_dir, engine_args=json.dumps(ENGINE_ARGS))
    try:
        running.start(ready_timeout=300)
        running.manage("web", "shell", "-c", UNLIMITED_PLAN)
        yield running
    finally:
        running.stop()
        shutil.rmtree(work, ignore_errors=True)


@pytest.fixture(scope="module")
def model(cluster) -> str:
    with httpx.Client(base_url=cluster.web_urls[0], headers=auth(cluster)) as http:
        return http.get("/v1/models").json()["data"][0]["id"]


def auth(cluster) -> dict:
    return {"Authorization": f"Bearer {cluster.api_key}"}


def redis_client(cluster) -> redis.Redis:
    return redis.Redis.from_url(cluster.redis_url, socket_timeout=10)


def live_workers(cluster) -> set[str]:
    r = redis_client(cluster)
    return {w.decode() for w in r.smembers(redis_keys.WORKERS_SET) if r.exists(redis_keys.heartbeat_key(w.decode()))}


def wait_for(condition, timeout: float, what: str) -> float:
    """time.monotonic() once condition() holds (polled; the timeout only bounds a failure)."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"{what} within {timeout:g}s"
        time.sleep(0.1)
    return time.monotonic()


def greedy_reference(cluster, model: str, max_tokens: int) -> str:
    with httpx.Client(base_url=cluster.web_urls[0], headers=auth(cluster), timeout=120) as http:
        answer = http.post("/v1/completions", json=completion_body(model, PROMPT, max_tokens, stream=False))
        assert answer.status_code == 200, answer.text
        return answer.json()["choices"][0]["text"]


def test_engine_host_partitioned_from_redis_for_10s(cluster, model, chaos_report):
    """engine host partitioned from Redis for 10 s, then healed (make cluster)"""
    bodies = [completion_body(model, PROMPT, 400, stream=True) for _ in range(8)]
    with ThreadPoolExecutor(1) as pool:
        load = pool.submit(lambda: asyncio.run(completion_streams(cluster.web_urls[0], cluster.api_key, bodies)))
        wait_for(
            lambda: any(
                json.loads(raw or b"{}").get("num_running", 0)
                for raw in [redis_client(cluster).hget(redis_keys.heartbeat_key("engine-1"), "stats")]
            ),
            60,
            "engine-1 running requests",
        )
        netns.partition("engine-1")
        cut_at = time.monotonic()
        try:
            lost_at = wait_for(lambda: "engine-1" not in live_workers(cluster), 30, "engine-1's heartbeat lapsing")
            during = greedy_reference(cluster, model, 8)  # the other worker serves meanwhile
            time.sleep(max(0.0, cut_at + 10 - time.monotonic()))  # the partition lasts its 10 s
        finally:
            netns.heal("engine-1")
        healed_at = time.monotonic()
        results, _ = load.result(timeout=300)
    [engine_1] = [c for c in cluster.supervisor.children if c.name == "engine-1"]
    back_at = wait_for(
        lambda: cluster.supervisor.tend() is None and "engine-1" in live_workers(cluster), 120, "engine-1 rejoining"
    )  # tend(): restarted as make run / compose would, if it died
    finished = [r for r in results if not r.problems(400)]
    errored = [r for r in results if r.error.startswith("error event")]
    chaos_report(
        "the partitioned worker's streams ended with an error event, the others finished; none hung; "
        "engine-2 served meanwhile; engine-1 rejoined after the heal",
        f"{len(finished)} finished, {len(errored)} error events of {len(results)}; heartbeat gone "
        f"{lost_at - cut_at:.1f} s after the cut; rejoined {back_at - healed_at:.1f} s after the heal "
        f"({'restarted' if engine_1.restarts else 'the same process'})",
    )
    assert during
    assert len(finished) + len(errored) == len(results), [r.problems(400) for r in results]
    assert errored, "engine-1 held some of the streams"


def test_latency_and_loss_on_the_web_to_redis_link_under_100_streams(cluster, model, chaos_report):
    """200 ms latency + 5% loss asked on what the web host sends (to Redis, PostgreSQL, clients), 100 streams"""
    max_tokens = 16
    reference = greedy_reference(cluster, model, max_tokens)
    bodies = [completion_body(model, PROMPT, max_tokens, stream=True) for _ in range(100)]
    applied = netns.degrade("web", 200, 5)
    try:
        results, wall = asyncio.run(completion_streams(cluster.web_urls[0], cluster.api_key, bodies))
    finally:
        netns.heal("web")
    whole = [r for r in results if not r.problems(max_tokens)]
    errored = [r for r in results if r.error.startswith("error event")]
    wrong_text = [r for r in whole if r.text != reference]
    ttfts = [r.ttft for r in whole if r.ttft is not None]
    chaos_report(
        "every stream whole (the greedy text, token for token) or ended with an error event",
        f"{applied}: {len(whole)} whole, {len(errored)} error events of 100 in {wall:.1f} s; TTFT p50 "
        f"{quantile(ttfts, 0.5):.2f} s, p99 {quantile(ttfts, 0.99):.2f} s"
        if ttfts
        else "no stream whole",
    )
    assert len(whole) + len(errored) == 100, [r.problems(max_tokens) for r in results if r not in whole][:5]
    assert not wrong_text, (wrong_text[0].text, reference)


def usage_rows(cluster) -> int:
    with psycopg.connect(cluster.database_url, connect_timeout=10) as conn:
        return conn.execute("SELECT count(*) FROM usage_usagerecord").fetchone()[0]


def test_postgresql_restarted_under_load(cluster, model, chaos_report):
    """PostgreSQL restarted (fast shutdown, the supervisor starts it again) under /v1 load (make cluster)"""
    before = usage_rows(cluster)
    [postgres] = [c for c in cluster.supervisor.children if c.name == "postgres"]
    bodies = [completion_body(model, PROMPT, 64, stream=i % 2 == 0) for i in range(40)]

    async def load():
        async with httpx.AsyncClient(
            headers=auth(cluster), timeout=300, limits=httpx.Limits(max_connections=len(bodies))
        ) as http:

            async def one(i, body):
                await asyncio.sleep(i * 0.1)  # spread over the restart
                response = await http.post(cluster.web_urls[i % 2] + "/v1/completions", json=body)
                return response.status_code, response.text

            return await asyncio.gather(*(one(i, b) for i, b in enumerate(bodies)))

    with ThreadPoolExecutor(1) as pool:
        answers = pool.submit(lambda: asyncio.run(load()))
        time.sleep(1.0)  # the load is under way
        stopped_at = time.monotonic()
        os.killpg(postgres.pid, signal.SIGINT)  # fast shutdown: open sessions are ended
        cluster.supervisor.watch(until=lambda: postgres.restarts >= 1 and postgres.running(), poll_seconds=0.2)
        up_at = wait_for(lambda: _accepts(cluster), 60, "PostgreSQL accepting again")
        statuses = [status for status, _ in answers.result(timeout=300)]
    ok = statuses.count(200)
    settled_by = time.monotonic() + 30  # the last answers' rows are written as their streams end
    while usage_rows(cluster) - before < ok and time.monotonic() < settled_by:
        time.sleep(0.2)
    recorded = usage_rows(cluster) - before
    chaos_report(
        "no 500; every answered request has its usage row",
        f"PostgreSQL back {up_at - stopped_at:.1f} s after the stop; {ok} of {len(bodies)} answered 200, "
        f"others {sorted(s for s in statuses if s != 200)}; {recorded} usage rows for {ok} answers",
    )
    assert 500 not in statuses
    assert recorded >= ok


def _accepts(cluster) -> bool:
    try:
        usage_rows(cluster)
        return True
    except psycopg.OperationalError:
        return False


def test_web_host_partitioned_mid_stream(cluster, model, chaos_report):
    """web host partitioned mid-stream: the engine aborts the orphaned request (make cluster)"""
    r = redis_client(cluster)
    before = set(r.scan_iter(match=redis_keys.output_stream("*")))
    stream = sse_stream(cluster.web_urls[0], cluster.api_key, model, 900)
    assert stream.started.wait(60), (stream.ended, stream.detail)
    [key] = set(r.scan_iter(match=redis_keys.output_stream("*"))) - before
    leases = set(r.scan_iter(match=redis_keys.lease_key("*")))
    assert leases, "the web process holds a lease while it streams"
    engines = [c for c in cluster.supervisor.children if c.name.startswith("engine-")]
    # Frozen, the engines cannot finish the request before its web host's lease lapses; thawed, they
    # look at the leases at once and abort it (as the make-run scenario does for a killed web process).
    for engine in engines:
        os.kill(engine.pid, signal.SIGSTOP)
    try:
        netns.partition("web")
        cut_at = time.monotonic()
        wait_for(lambda: not any(r.exists(lease) for lease in leases), 30, "the web host's lease lapsing")
    finally:
        for engine in engines:
            os.kill(engine.pid, signal.SIGCONT)
    try:
        ended_at = wait_for(lambda: _terminal_event(r, key) is not None, 30, "a terminal event")
        terminal = _terminal_event(r, key)
    finally:
        netns.heal("web")
    assert stream.done.wait(120)
    chaos_report(
        "the engine aborted the orphaned request; the client's stream ended",
        f"aborted {ended_at - cut_at:.1f} s after the partition (lease {redis_keys.LEASE_TTL_S:g} s); "
        f"client saw {stream.ended!r}",
    )
    assert terminal.get("finish_reasons") == ["abort"], terminal
    wait_for(lambda: greedy_reference(cluster, model, 4) is not None, 120, "the web host serving again")


def _terminal_event(r: redis.Redis, key: bytes) -> dict | None:
    for _, fields in r.xrange(key):
        for event in redis_keys.decode(fields[b"events"]):
            if event["type"] in redis_keys.TERMINAL_EVENTS:
                return event
    return None
