"""What happens to a stream when its client leaves, or its engine worker dies."""

from __future__ import annotations

import json
import signal
import time

import httpx
import openai
import pytest

from inference import protocol
from tests.platform.live_stack import LiveStack

pytestmark = pytest.mark.slow


def wait_for(predicate, timeout=15.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"not within {timeout}s")


def test_closing_a_stream_aborts_the_request_and_frees_its_kv_blocks(live_stack):
    before = live_stack.worker_stats()[0]
    # As long a generation as the stack's max_model_len (512) allows; the client hangs up right
    # after the first chunks, while the tiny model is still far from done.
    body = {
        "model": live_stack.model_name,
        "prompt": [5, 6, 7],
        "max_tokens": 500,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    headers = {"Authorization": f"Bearer {live_stack.api_key}"}
    with httpx.stream("POST", live_stack.base_url + "/v1/completions", json=body, headers=headers, timeout=60) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        first = [next(lines) for _ in range(6)]  # a few chunks, then hang up
        assert any(line.startswith("data: ") for line in first)
    # the response is closed here, mid-generation: the worker aborts it and frees its blocks
    stats = wait_for(
        lambda: (
            (s := live_stack.worker_stats()[0])
            and s["aborts_total"] == before["aborts_total"] + 1
            and s["inflight"] == 0
            and s["num_running"] == 0
            and s["blocks_used"] == 0
            and s
        )
    )
    assert stats["generation_tokens_total"] < before["generation_tokens_total"] + 500
    rows = wait_for(
        lambda: live_stack.sql(
            "SELECT status_code, error_code, completion_tokens FROM usage_usagerecord "
            "WHERE endpoint = '/v1/completions' ORDER BY id DESC LIMIT 1"
        )
    )
    assert rows[0][:2] == (499, "client_disconnected") and 0 < rows[0][2] < 500


def test_a_streamed_request_is_submitted_with_its_web_processs_lease(live_stack):
    """The submit runs on the bookkeeping thread, with the event loop's lease: a web process that
    dies mid-stream still gets its requests aborted (tests/chaos: test_web_kill_mid_stream)."""
    client = openai.OpenAI(base_url=live_stack.base_url + "/v1", api_key=live_stack.api_key, max_retries=0)
    stream = client.completions.create(
        model=live_stack.model_name,
        prompt=[4, 5, 6],
        max_tokens=50,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    first = next(iter(stream))
    r = live_stack.redis()
    submitted = [
        protocol.decode(fields[b"data"]) for _id, fields in r.xrange(protocol.request_stream(live_stack.model_name))
    ]
    [request] = [m for m in submitted if m["request_id"] == first.id]
    assert request["lease_id"] and r.pttl(protocol.lease_key(request["lease_id"])) > 0
    for _chunk in stream:  # to its end: the next test starts with nothing running
        pass


@pytest.fixture(scope="module")
def doomed_stack(tiny_model_dir, tmp_path_factory):
    """A stack of its own with two engine workers (`manage.py engine` x2 on one consumer group), killed here."""
    with LiveStack.start(tiny_model_dir, tmp_path_factory.mktemp("doomed-stack"), workers=2) as stack:
        yield stack


def _process_running(stack: LiveStack, worker_id: str) -> str:
    pid = int(stack.redis().hget(f"tessera:engine:worker:{worker_id}", "pid"))
    return next(name for name, proc in stack.processes.items() if proc.pid == pid)


def test_worker_death_and_shutdown_never_leave_a_client_waiting(doomed_stack):
    stack = doomed_stack
    client = openai.OpenAI(base_url=stack.base_url + "/v1", api_key=stack.api_key, max_retries=0)
    stream = client.completions.create(
        model=stack.model_name,
        prompt=[4, 5, 6],
        max_tokens=400,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    first = next(iter(stream))
    [(_id, fields)] = stack.redis().xrange(f"tessera:engine:out:{first.id}", count=1)
    victim_id = json.loads(fields[b"events"])[0]["worker_id"]
    victim = _process_running(stack, victim_id)
    stack.kill(victim)  # SIGKILL: no clean-up, no goodbye
    started = time.monotonic()
    with pytest.raises(openai.APIError) as info:
        for _chunk in stream:
            pass
    assert "worker" in str(info.value)
    assert time.monotonic() - started < 3 + 1 + 3, "the client learns within heartbeat TTL + one poll"

    # the other worker of the group carries on
    wait_for(lambda: len(httpx.get(stack.base_url + "/health").json()["workers"]) == 1)
    reply = client.completions.create(model=stack.model_name, prompt=[4, 5, 6], max_tokens=4)
    assert reply.usage.completion_tokens == 4

    # SIGTERM: the survivor drains, removes its heartbeat and consumer, and exits 0
    survivor_id = httpx.get(stack.base_url + "/health").json()["workers"][0]
    survivor = _process_running(stack, survivor_id)
    process = stack.processes[survivor]
    process.send_signal(signal.SIGTERM)
    assert process.wait(30) == 0
    r = stack.redis()
    assert not r.exists(f"tessera:engine:worker:{survivor_id}")
    consumers = {
        c["name"].decode()
        for c in r.xinfo_consumers(protocol.request_stream(stack.model_name), protocol.CONSUMER_GROUP)
    }
    assert survivor_id not in consumers
    assert httpx.get(stack.base_url + "/health").status_code == 503
    with pytest.raises(openai.InternalServerError) as info:
        client.completions.create(model=stack.model_name, prompt=[4, 5, 6], max_tokens=4)
    assert info.value.status_code == 503 and info.value.body["code"] == "engine_unavailable"
