"""Fair share through the real stack: two users' API keys, one web server, Redis and one engine worker.

User B floods (many concurrent streamed requests; the live stack's quotas are raised so the concurrency
quota does not do the scheduler's job), then user A sends a few requests. The engine runs one sequence
at a time, so the order in which requests get their first token is the order the scheduler admitted
them. That order is read after the run from the worker's own output streams (each request's first
token entry id on the one Redis clock), never from times measured by the test. The worker is given
room for all of them (ENGINE_MAX_INFLIGHT): requests left in the Redis stream are read first come,
first served, whatever the engine's policy (docs/architecture.md, Fair share).

- `fair`: A is admitted in turn with B (A's counter is lifted to B's on arrival, then B's running
  request keeps growing B's): A's requests all start while most of B's backlog still waits;
- `fcfs`: every B request that was queued before A starts before any of A's.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import openai
import pytest

from inference import protocol
from tests.platform.live_stack import LiveStack

pytestmark = pytest.mark.slow

FLOOD = 12  # B's requests, all queued before A's
A_REQUESTS = 3
MAX_TOKENS = 32
PROMPT = "Fair share between tenants keeps one user from starving the others"
USER_A = "tenant-a"
# The worker must hold the whole backlog: fair share orders what the engine holds, and a worker reads at
# most max_inflight requests (by default 8 x max_num_seqs under fair) from the stream; the rest wait in FCFS.
HELD = 2 * (FLOOD + A_REQUESTS)


@dataclass(frozen=True)
class Served:
    user: str
    submitted: tuple[int, int]  # its entry id on the one request stream: the order requests arrived in
    accepted: tuple[int, int]  # the worker's `accepted` entry id: when the engine took the request
    first_token: tuple[int, int]  # the first delta's entry id: when the scheduler admitted it
    completion_tokens: int


def _entry_id(raw: bytes) -> tuple[int, int]:
    ms, seq = raw.decode().split("-")
    return int(ms), int(seq)


def _first_entry(stack: LiveStack, request_id: str, kind: str) -> tuple[int, int]:
    for entry_id, fields in stack.redis().xrange(protocol.output_stream(request_id)):
        events = protocol.events_of({k.decode(): v.decode() for k, v in fields.items()})
        if any(e["type"] == kind and (kind != "delta" or e["token_ids"]) for e in events):
            return _entry_id(entry_id)
    raise AssertionError(f"{request_id}: no {kind} event in its output stream")


def _submitted(stack: LiveStack) -> dict[str, tuple[int, int]]:
    entries = stack.redis().xrange(protocol.request_stream(stack.model_name))
    return {protocol.EngineRequest.from_fields(fields).request_id: _entry_id(entry_id) for entry_id, fields in entries}


def _served(stack: LiveStack) -> list[Served]:
    rows = stack.sql(
        "SELECT r.request_id, u.username, r.completion_tokens FROM usage_usagerecord r"
        " JOIN auth_user u ON u.id = r.user_id WHERE r.status_code = 200"
    )
    submitted = _submitted(stack)
    return [
        Served(user, submitted[rid], _first_entry(stack, rid, "accepted"), _first_entry(stack, rid, "delta"), tokens)
        for rid, user, tokens in rows
    ]


def _stream_one(client: openai.OpenAI) -> int:
    stream = client.completions.create(
        model="tiny-llama",
        prompt=PROMPT,
        max_tokens=MAX_TOKENS,
        temperature=0.0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    return sum(len(chunk.choices[0].text) > 0 for chunk in stream if chunk.choices)


def _flood_then_a(stack: LiveStack, key_a: str) -> list[Served]:
    client_b = openai.OpenAI(base_url=stack.base_url + "/v1", api_key=stack.api_key, max_retries=0, timeout=600)
    client_a = openai.OpenAI(base_url=stack.base_url + "/v1", api_key=key_a, max_retries=0, timeout=600)
    with ThreadPoolExecutor(FLOOD + A_REQUESTS) as pool:
        flood = [pool.submit(_stream_one, client_b) for _ in range(FLOOD)]
        _wait_submitted(stack, FLOOD)
        a = [pool.submit(_stream_one, client_a) for _ in range(A_REQUESTS)]
        for future in flood + a:
            future.result()
    served = _usage_rows(stack, FLOOD + A_REQUESTS)
    assert sorted(s.completion_tokens for s in served) == [MAX_TOKENS] * (FLOOD + A_REQUESTS)  # nothing lost
    return served


def _wait_submitted(stack: LiveStack, count: int) -> None:
    """Until `count` requests are on the engine's request stream (entries stay there once read)."""
    stream = protocol.request_stream(stack.model_name)
    deadline = time.monotonic() + 120
    while stack.redis().xlen(stream) < count:
        assert time.monotonic() < deadline, f"{stack.redis().xlen(stream)} of {count} requests submitted"
        time.sleep(0.02)


def _usage_rows(stack: LiveStack, expected: int) -> list[Served]:
    """The usage rows are written as each request finishes, just after its last chunk: wait for all of them."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        served = _served(stack)
        if len(served) >= expected:
            return served
        time.sleep(0.1)
    raise AssertionError(f"{len(_served(stack))} usage rows, {expected} expected")


def _order(served: list[Served]) -> tuple[list[Served], list[Served]]:
    a = sorted((s for s in served if s.user == USER_A), key=lambda s: s.first_token)
    b = sorted((s for s in served if s.user != USER_A), key=lambda s: s.first_token)
    return a, b


def _stack(tiny_model_dir, work_dir, policy: str) -> LiveStack:
    stack = LiveStack.start(
        tiny_model_dir,
        work_dir,
        engine_args={"scheduling_policy": policy, "max_num_seqs": 1, "num_kv_blocks": 64},
        env={"ENGINE_MAX_INFLIGHT": str(HELD)},
    )
    stack.manage(
        "shell",
        "-c",
        f"from django.contrib.auth.models import User; User.objects.create_user({USER_A!r}, password='x')",
    )
    return stack


def _key_of(stack: LiveStack, username: str) -> str:
    return stack.manage("create_api_key", username, "--name", "fair").strip().splitlines()[-1]


def test_fair_share_admits_a_light_user_while_another_floods(tiny_model_dir, tmp_path):
    with _stack(tiny_model_dir, tmp_path, "fair") as stack:
        served = _flood_then_a(stack, _key_of(stack, USER_A))
    a, b = _order(served)
    a_arrived = min(s.accepted for s in a)
    backlog = [s for s in b if s.first_token > a_arrived]  # B's requests still waiting when A arrived
    assert len(backlog) >= FLOOD // 2, f"B's backlog had drained before A arrived ({len(backlog)} left)"
    # Each of A's admissions comes after at most one of B's (the engine holds one sequence: counters
    # alternate), so A's requests all start with most of B's backlog still waiting.
    b_before_a_done = [s for s in backlog if s.first_token < a[-1].first_token]
    assert len(b_before_a_done) <= A_REQUESTS + 1, (len(b_before_a_done), len(backlog))
    assert backlog[-1].first_token > a[-1].first_token


def test_fcfs_keeps_a_light_user_behind_the_flood(tiny_model_dir, tmp_path):
    with _stack(tiny_model_dir, tmp_path, "fcfs") as stack:
        served = _flood_then_a(stack, _key_of(stack, USER_A))
    a, b = _order(served)
    # Every B request reached the engine before A's did, and FCFS serves them all first. (Compared on the one
    # request stream: ids of different output streams order only to the millisecond, and the worker may
    # claim B's last requests and A's in one read.)
    assert max(s.submitted for s in b) < min(s.submitted for s in a)
    assert max(s.first_token for s in b) < a[0].first_token
