"""The web process's lease (lease_id): requests an event loop will follow are submitted with its async client's
lease, which that client keeps alive while the loop runs; a worker aborts (and frees) the requests
of a lease that lapsed, i.e. of a web process that died mid-stream. Batch requests carry none."""

from __future__ import annotations

import asyncio
import time

import redis
from django.conf import settings

from engine_client import client as engine
from inference import protocol
from inference.worker import EngineWorker, WorkerConfig
from tests.inference.worker_helpers import MODEL, llm, r, wait_for  # noqa: F401 (fixtures)

PROMPT = [1, 5, 9, 13]
LONG = {"temperature": 0.0, "max_tokens": 200, "ignore_eos": True}


def stepped_worker(llm) -> EngineWorker:
    """A worker driven by hand (no thread), so each test decides when it reads and checks leases."""
    worker = EngineWorker(llm.llm_engine, redis.Redis.from_url(settings.REDIS_URL), WorkerConfig(model_name=MODEL))
    worker.setup()
    return worker


def terminal(r, request_id: str) -> dict | None:
    for _, fields in r.xrange(protocol.output_stream(request_id)):
        for event in protocol.decode(fields[b"events"]):
            if event["type"] in protocol.TERMINAL_EVENTS:
                return event
    return None


def test_followed_submissions_carry_the_loops_lease_and_batch_ones_none(r):
    async def submit():
        lease_id = engine.aclient().lease()
        engine.client().submit(model=MODEL, prompt_token_ids=PROMPT, lease_id=lease_id)
        return lease_id

    lease_id = asyncio.run(submit())
    engine.client().submit(model=MODEL, prompt_token_ids=PROMPT)
    leased, batch = [protocol.decode(f[b"data"]) for _, f in r.xrange(protocol.request_stream(MODEL))]
    assert leased["lease_id"] == lease_id and batch["lease_id"] is None
    assert 0 < r.pttl(protocol.lease_key(lease_id)) <= protocol.LEASE_TTL_S * 1000


def test_the_worker_aborts_only_requests_whose_lease_lapsed_and_frees_their_blocks(llm, r):
    worker = stepped_worker(llm)
    try:
        r.set(protocol.lease_key("alive"), "1", ex=60)
        orphan = engine.client().submit(model=MODEL, prompt_token_ids=PROMPT, sampling_params=LONG)
        followed = engine.client().submit(model=MODEL, prompt_token_ids=PROMPT, sampling_params=LONG)
        batch = engine.client().submit(model=MODEL, prompt_token_ids=PROMPT, sampling_params=LONG)
        _set_lease_id(r, orphan, "died")  # its web process's lease is gone
        _set_lease_id(r, followed, "alive")
        worker.read_requests(block_ms=1000)
        worker.step()
        assert set(worker.states) == {orphan, followed, batch}
        free_before = llm.llm_engine.kv.pool.num_free

        worker.abort_lapsed_leases()

        assert terminal(r, orphan)["finish_reasons"] == ["abort"]
        assert set(worker.states) == {followed, batch}  # a live lease and no lease (batch) keep running
        assert terminal(r, followed) is None and terminal(r, batch) is None
        assert llm.llm_engine.kv.pool.num_free > free_before
    finally:
        llm.llm_engine.abort_request(list(worker.states))
        worker.shutdown()


def test_the_lease_lives_as_long_as_the_submitting_event_loop_and_lapses_after(r, monkeypatch):
    monkeypatch.setattr(protocol, "LEASE_TTL_S", 1.0)
    monkeypatch.setattr(protocol, "LEASE_REFRESH_S", 0.1)

    async def web_process():
        client = engine.aclient()
        engine.client().submit(model=MODEL, prompt_token_ids=PROMPT, lease_id=client.lease())
        await asyncio.sleep(2.5)  # 2.5 lease lifetimes, following nothing: still alive
        key = protocol.lease_key(client.lease_id)
        return key, await client.r.exists(key)

    key, alive_while_running = asyncio.run(web_process())  # then the loop is gone, as in a killed process
    assert alive_while_running
    assert wait_for(lambda: not r.exists(key), timeout=protocol.LEASE_TTL_S + 2)


def test_the_worker_rings_a_leases_doorbell_when_it_writes_to_a_quiet_stream_after_the_events(llm, r, monkeypatch):
    """A web process's hub names only hot streams in each XREAD (engine_client.StreamHub): the worker rings
    the lease's doorbell for a stream it writes to after RING_AFTER_S without a write, and not for one it
    writes to every step; the ring comes after the events it announces. Batch requests ring nothing."""
    monkeypatch.setattr(protocol, "RING_AFTER_S", 3600.0)  # no step of this test takes that long
    worker = stepped_worker(llm)
    doorbell = protocol.hub_doorbell("web-1")
    try:
        followed = engine.client().submit(model=MODEL, prompt_token_ids=PROMPT, sampling_params=LONG)
        engine.client().submit(model=MODEL, prompt_token_ids=PROMPT, sampling_params=LONG)  # a batch line
        _set_lease_id(r, followed, "web-1")

        def rings() -> list[tuple[str, list[str]]]:
            worker.output.flush()
            return [(entry_id.decode(), protocol.rung_request_ids(f)) for entry_id, f in r.xrange(doorbell)]

        sent = []
        send = worker.output.send
        monkeypatch.setattr(worker.output, "send", lambda pipe: sent.append(list(pipe.command_stack)) or send(pipe))

        worker.read_requests(block_ms=1000)  # the accepted events: never written to before
        assert [ids for _, ids in rings()] == [[followed]]
        worker.step()
        worker.step()
        assert len(rings()) == 1  # written to in every step: hot in its hub, no ring
        worker.states[followed].written_at -= 3601  # as if it had waited in the queue since
        worker.step()
        ids = rings()[-1][1]
        assert len(rings()) == 2 and ids == [followed]
        written = [args[1] for args, _ in sent[-1]]  # each command's key, in the order the pipeline sends them
        assert written.index(protocol.output_stream(followed)) < written.index(doorbell)  # the events first
        assert 0 < r.ttl(doorbell) <= protocol.OUTPUT_TTL_S
    finally:
        llm.llm_engine.abort_request(list(worker.states))
        worker.shutdown()


def _set_lease_id(r, request_id: str, lease_id: str) -> None:
    """Rewrite a queued request's lease id (as a web process with that lease would have submitted it)."""
    stream = protocol.request_stream(MODEL)
    for entry_id, fields in r.xrange(stream):
        data = protocol.decode(fields[b"data"])
        if data["request_id"] == request_id:
            r.xdel(stream, entry_id)
            data["lease_id"] = lease_id
            r.xadd(stream, {"data": protocol.encode(data)})
            time.sleep(0.002)  # distinct entry ids keep the submission order readable
