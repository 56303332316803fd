"""Faults between hosts of `make cluster` (deploy/cluster.py: five network namespaces on veth links,
PostgreSQL and Redis on one of them, a tiny model in the two engine workers): partitions (nftables in
the host's namespace), latency and loss (deploy/cluster.py's degrade: an NFQUEUE delayer and an
nftables drop), a PostgreSQL restart, and processes killed on their hosts with batches and playground
answers in flight, checked on PostgreSQL. One cluster serves the module's scenarios in turn.
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
from tests.chaos.clients import (
    FINAL_BATCH_STATUSES,
    batch_lines,
    check_exactly_once,
    completion_body,
    completion_streams,
    create_batch,
    openai_client,
    quantile,
    sse_stream,
    wait_for_batch,
    ws_chat,
)
from tests.tiny_models import make_tiny_model

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
    "max_model_len": 2048,
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
def cluster(tmp_path_factory):
    work = Path("/tmp") / f"tessera-chaos-cluster-{os.getpid()}"  # PostgreSQL's user must reach it
    work.mkdir(mode=0o755)
    # 2048 positions: a conversation still fits after a reply that ran to CHAT_TOKENS
    model = make_tiny_model(tmp_path_factory.mktemp("tiny-llama-2k"), "llama", max_position_embeddings=2048)
    running = netns.Cluster(work_dir=work, model=str(model), engine_args=json.dumps(ENGINE_ARGS))
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
    """200 ms latency + 5% loss on what the web host sends to the data host (Redis, PostgreSQL), 100 streams"""
    max_tokens = 16
    reference = greedy_reference(cluster, model, max_tokens)
    bodies = [completion_body(model, PROMPT, max_tokens, stream=True) for _ in range(100)]
    rtt_before = netns.redis_ping_ms("web", cluster.redis_url)
    applied = netns.degrade("web", 200, 5, to="data")
    held = ""
    try:
        rtt_during = netns.redis_ping_ms("web", cluster.redis_url)  # a new connection from the web host
        results, wall = asyncio.run(completion_streams(cluster.web_urls[0], cluster.api_key, bodies))
    finally:
        held = netns.heal("web")
    rtt_after = netns.redis_ping_ms("web", cluster.redis_url)
    whole = [r for r in results if not r.problems(max_tokens)]
    errored = [r for r in results if r.error.startswith("error event")]
    wrong_text = [r for r in whole if r.text != reference]
    ttfts = [r.ttft for r in whole if r.ttft is not None]
    chaos_report(
        "every stream whole (the greedy text, token for token) or ended with an error event",
        f"{applied}: Redis PING from the web host {rtt_before:.1f} ms before, {rtt_during:.0f} ms during, "
        f"{rtt_after:.1f} ms after the heal; {held}; {len(whole)} whole, {len(errored)} error events of 100 "
        f"in {wall:.1f} s; TTFT p50 "
        + (f"{quantile(ttfts, 0.5):.2f} s, p99 {quantile(ttfts, 0.99):.2f} s" if ttfts else "-: no stream whole"),
    )
    if "ms latency" in applied:  # the delay really is on the link: a PING waits for it at least once
        assert rtt_during >= 200, (applied, rtt_during)
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


# ---------------------------------------------------------------- batches and chat on PostgreSQL


def child(cluster, name: str):
    [found] = [c for c in cluster.supervisor.children if c.name == name]
    return found


def test_celery_worker_killed_mid_batch_on_its_host(cluster, model, chaos_report):
    """Celery worker and its pool `kill -9` mid-batch on the celery host (32 lines; make cluster, PostgreSQL)"""
    client = openai_client(cluster.web_urls[0], cluster.api_key)
    lines = batch_lines(model, 32)
    batch = create_batch(client, lines)
    wait_for_batch(client, batch.id, lambda b: b.request_counts.completed >= 4, 300, tick=cluster.supervisor.tend)
    worker = child(cluster, "worker")
    killed_at = time.monotonic()
    os.killpg(worker.pid, signal.SIGKILL)  # the whole container, as `docker kill`: the main process and its pool
    at_kill = client.batches.retrieve(batch.id)
    assert at_kill.status == "in_progress" and at_kill.request_counts.completed < len(lines), at_kill
    final = wait_for_batch(
        client, batch.id, lambda b: b.status in FINAL_BATCH_STATUSES, 600, tick=cluster.supervisor.tend
    )  # tend(): the supervisor restarts the worker; beat's watchdog hands the batch to it once the lease lapses
    done_at = time.monotonic()
    check_exactly_once(client, final, lines)
    with psycopg.connect(cluster.database_url, connect_timeout=10) as conn:
        statuses, retried = conn.execute(
            "SELECT array_agg(DISTINCT l.status), count(*) FILTER (WHERE l.attempts > 1) FROM batches_batchline l "
            "JOIN batches_batch b ON b.id = l.batch_id WHERE b.public_id = %s",
            (batch.id,),
        ).fetchone()
    chaos_report(
        "the supervisor restarted the worker; the watchdog resumed the batch; every custom_id exactly once, "
        "request_counts exact (PostgreSQL)",
        f"{at_kill.request_counts.completed}/32 done at the kill; 32/32 completed, 0 failed, "
        f"{done_at - killed_at:.1f} s after the kill (worker restarted {worker.restarts}x); {retried} lines "
        f"run again by the new runner; every line {'/'.join(statuses)} in PostgreSQL",
    )
    assert statuses == ["completed"], statuses


CHAT_TOKENS = 900


def chat_branch(cluster, conversation_id: str) -> list[dict]:
    """The conversation's branch on screen, from PostgreSQL: its current leaf back to the first turn, root first."""
    with psycopg.connect(cluster.database_url, connect_timeout=10) as conn:
        [leaf] = conn.execute(
            "SELECT current_leaf_id FROM chat_conversation WHERE id = %s", (conversation_id,)
        ).fetchone()
        columns = ("id", "parent_id", "role", "status", "content", "request_id")
        rows = conn.execute(
            f"SELECT {', '.join(columns)} FROM chat_message WHERE conversation_id = %s", (conversation_id,)
        ).fetchall()
    messages = {row[0]: dict(zip(columns, row)) for row in rows}
    branch = []
    while leaf is not None:
        branch.append(messages[leaf])
        leaf = messages[leaf]["parent_id"]
    return branch[::-1]


def stored_message(cluster, message_id: int) -> tuple[str, str]:
    """(status, content) of a chat message in PostgreSQL."""
    with psycopg.connect(cluster.database_url, connect_timeout=10) as conn:
        return conn.execute("SELECT status, content FROM chat_message WHERE id = %s", (message_id,)).fetchone()


def usage_rows_for(cluster, request_id: str) -> int:
    with psycopg.connect(cluster.database_url, connect_timeout=10) as conn:
        return conn.execute("SELECT count(*) FROM usage_usagerecord WHERE request_id = %s", (request_id,)).fetchone()[0]


def savepoint(cluster, reply) -> str:
    """The text the reply's relay has saved so far (save_progress, every 0.5 s of deltas), once there is some."""
    wait_for(lambda: reply.message_id is not None and stored_message(cluster, reply.message_id)[1], 60, "a savepoint")
    status, content = stored_message(cluster, reply.message_id)
    assert status == "streaming" and not reply.done.is_set(), (status, reply.ended, reply.detail)
    return content


def described(branch: list[dict]) -> str:
    return " > ".join(f"{m['role']} {m['status']}" for m in branch)


def next_turn(cluster, conversation_id: str):
    """A second turn in the conversation through the other web process; its Outcome once it ended."""
    turn = ws_chat(cluster.web_urls[1], netns.ADMIN, cluster.admin_password, 16, conversation_id=conversation_id)
    assert turn.done.wait(120), "the next turn never ended"
    return turn


def test_engine_workers_killed_mid_chat_reply(cluster, model, chaos_report):
    """both engine workers `kill -9` mid-answer of a playground reply (websocket on web-1; make cluster, PostgreSQL)"""
    reply = ws_chat(cluster.web_urls[0], netns.ADMIN, cluster.admin_password, CHAT_TOKENS)
    assert reply.started.wait(60), (reply.ended, reply.detail)
    saved = savepoint(cluster, reply)
    engines = [child(cluster, name) for name in ("engine-1", "engine-2")]
    for engine in engines:
        os.kill(engine.pid, signal.SIGSTOP)  # frozen first, so the answer cannot finish before the kill
    assert not reply.done.is_set(), (reply.ended, reply.detail)
    killed_at = time.monotonic()
    for engine in engines:
        os.killpg(engine.pid, signal.SIGKILL)
    assert reply.done.wait(60), "the playground client still waits 60 s after the kill"
    back_at = wait_for(
        lambda: cluster.supervisor.tend() is None and live_workers(cluster) == {"engine-1", "engine-2"},
        300,
        "both engine workers back",
    )
    [user, answer] = chat_branch(cluster, reply.conversation_id)
    turn = next_turn(cluster, reply.conversation_id)
    branch = chat_branch(cluster, reply.conversation_id)
    chaos_report(
        "the client got an error; the reply saved as error with exactly the text it was sent (the savepoint a "
        "prefix of it), one usage row; the conversation went on from it (PostgreSQL)",
        f"error {reply.at - killed_at:.1f} s after the kill; savepoint {len(saved)} chars, saved reply "
        f"{len(answer['content'])} chars = the {len(reply.text)} streamed; next turn {turn.ended}; engines back "
        f"{back_at - killed_at:.1f} s after the kill; branch {described(branch)}",
    )
    assert reply.ended == "error", (reply.ended, reply.detail)
    assert (user["role"], answer["role"], answer["status"]) == ("user", "assistant", "error"), answer
    assert answer["content"] == reply.text and answer["content"].startswith(saved), (answer["content"], saved)
    assert usage_rows_for(cluster, answer["request_id"]) == 1
    assert turn.ended == "finished", (turn.ended, turn.detail)
    assert [m["id"] for m in branch[:2]] == [user["id"], answer["id"]] and len(branch) == 4, branch
    assert [(m["role"], m["status"]) for m in branch[2:]] == [("user", "complete"), ("assistant", "complete")]


def test_web_process_killed_mid_chat_reply(cluster, model, chaos_report):
    """web process `kill -9` mid-answer of a playground reply, then the stale-reply sweep (make cluster, PostgreSQL)"""
    r = redis_client(cluster)
    before = set(r.scan_iter(match=redis_keys.output_stream("*")))
    reply = ws_chat(cluster.web_urls[0], netns.ADMIN, cluster.admin_password, CHAT_TOKENS)
    assert reply.started.wait(60), (reply.ended, reply.detail)
    [key] = set(r.scan_iter(match=redis_keys.output_stream("*"))) - before
    saved = savepoint(cluster, reply)
    web = child(cluster, "web-1")
    killed_at = time.monotonic()
    os.killpg(web.pid, signal.SIGKILL)
    assert reply.done.wait(30) and reply.ended == "cut", (reply.ended, reply.detail)
    # The engine ends the request: it aborts it once web-1's lease lapses, or it reaches max_tokens first.
    wait_for(lambda: _terminal_event(r, key) is not None, 60, "the request ending in the engine")
    terminal = _terminal_event(r, key)
    status, kept = stored_message(cluster, reply.message_id)  # what a reload shows until the sweep
    refused = next_turn(cluster, reply.conversation_id)  # the answer is still "streaming": no new turn yet
    swept = cluster.manage(
        "celery",
        "shell",
        "-c",
        "from chat.services import finish_stale_replies; print(finish_stale_replies(older_than_s=0))",
    ).split()[-1]  # beat's chat.finish_stale_replies, without its 10-minute age
    [user, answer] = chat_branch(cluster, reply.conversation_id)
    back_at = wait_for(
        lambda: cluster.supervisor.tend() is None and web.restarts >= 1 and cluster.health(cluster.web_urls[0]),
        120,
        "web-1 back",
    )
    turn = next_turn(cluster, reply.conversation_id)
    branch = chat_branch(cluster, reply.conversation_id)
    chaos_report(
        "until the sweep the reply stays streaming with its savepoint and a new turn is refused; the sweep saves it "
        "from the engine's stream (the savepoint and what the client saw prefixes of it), one usage row; the "
        "conversation went on from it (PostgreSQL)",
        f"the engine ended the request ({', '.join(terminal.get('finish_reasons') or [])}); savepoint {len(kept)} "
        f"chars ({len(saved)} at the kill, the client had {len(reply.text)}); new turn before the sweep: "
        f"{refused.ended} {refused.detail}; swept {swept}: {answer['status']}, {len(answer['content'])} chars; "
        f"web-1 back {back_at - killed_at:.1f} s after the kill; next turn {turn.ended}; branch {described(branch)}",
    )
    assert status == "streaming" and kept.startswith(saved), (status, kept, saved)
    assert (refused.ended, refused.detail) == ("error", "busy"), (refused.ended, refused.detail)
    assert swept == "1"
    assert (user["role"], answer["role"]) == ("user", "assistant")
    assert answer["status"] == ("stopped" if terminal.get("finish_reasons") == ["abort"] else "complete"), answer
    assert answer["content"].startswith(kept) and answer["content"].startswith(reply.text), answer["content"]
    assert usage_rows_for(cluster, answer["request_id"]) == 1
    assert turn.ended == "finished", (turn.ended, turn.detail)
    assert [m["id"] for m in branch[:2]] == [user["id"], answer["id"]] and len(branch) == 4, branch
    assert [(m["role"], m["status"]) for m in branch[2:]] == [("user", "complete"), ("assistant", "complete")]
