"""StreamHub: every astream of one event loop reads through one XREAD (engine_client.client).

Output streams are written here by hand, in the worker's format, so each test controls exactly
when which event exists.
"""

from __future__ import annotations

import asyncio
import time

from engine_client import client as engine
from inference import protocol
from tests.inference.worker_helpers import r  # noqa: F401 (fixture)

DELTA = {"type": "delta", "index": 0, "text": "x", "token_ids": [1], "finish_reason": None}
FINISH = {"type": "finish", "finish_reasons": ["length"], "usage": {}, "metrics": {}}


def write(client, request_id: str, *events: dict) -> str:
    """XADD one entry, as the worker does once per step; returns its entry id."""
    entry_id = client.xadd(protocol.output_stream(request_id), {"events": protocol.encode(list(events))})
    return entry_id.decode()


async def collect(request_id: str, last_id: str = "0-0") -> list[dict]:
    return [e async for e in engine.aclient().stream(request_id, last_id=last_id, timeout=30)]


def test_concurrent_streams_share_one_reader_and_get_only_their_own_events(r):
    async def run():
        tasks = [asyncio.create_task(collect(f"req-{i}")) for i in range(3)]
        await asyncio.sleep(0.1)  # all three are following now
        hub = engine.aclient().hub
        assert set(hub.by_key) == {protocol.output_stream(f"req-{i}") for i in range(3)}
        reader = hub.reader
        for i in range(3):
            write(r, f"req-{i}", {**DELTA, "text": f"t{i}"})
        for i in range(3):
            write(r, f"req-{i}", FINISH)
        results = await asyncio.gather(*tasks)
        assert hub.reader is reader and not hub.by_key  # one reader served all; nobody is left following
        return results

    for i, events in enumerate(asyncio.run(run())):
        assert [e["type"] for e in events] == ["delta", "finish"]
        assert events[0]["text"] == f"t{i}"


def test_a_stream_that_joins_while_the_reader_blocks_is_served_at_once(r):
    async def run():
        idle = asyncio.create_task(collect("idle"))  # keeps the reader blocked in XREAD (up to 1 s)
        await asyncio.sleep(0.2)
        write(r, "late", DELTA, FINISH)
        started = time.monotonic()
        events = await collect("late")
        waited = time.monotonic() - started
        write(r, "idle", FINISH)
        await idle
        return events, waited

    events, waited = asyncio.run(run())
    assert [e["type"] for e in events] == ["delta", "finish"]
    assert waited < 0.5, f"the new stream waited {waited:.2f}s for the blocked XREAD to time out"


def test_two_readers_of_one_stream_each_resume_after_their_own_entry(r):
    first = write(r, "shared", {**DELTA, "text": "a"})
    write(r, "shared", {**DELTA, "text": "b"})

    async def run():
        from_start = asyncio.create_task(collect("shared"))
        resumed = asyncio.create_task(collect("shared", last_id=first))  # a reconnecting browser tab
        await asyncio.sleep(0.1)
        write(r, "shared", FINISH)
        return await from_start, await resumed

    from_start, resumed = asyncio.run(run())
    assert [e.get("text") for e in from_start] == ["a", "b", None]
    assert [e.get("text") for e in resumed] == ["b", None]


def test_quiet_streams_share_one_liveness_read_and_a_dead_worker_ends_them(r, monkeypatch):
    reads = []
    real = engine.AsyncEngineClient.live_workers

    async def counting(client):
        reads.append(time.monotonic())
        return await real(client)

    monkeypatch.setattr(engine.AsyncEngineClient, "live_workers", counting)
    for i in range(3):  # claimed by a worker that has no heartbeat (it died)
        write(r, f"orphan-{i}", {"type": "accepted", "worker_id": "ghost", "prompt_tokens": 3})

    async def run():
        return await asyncio.gather(*(collect(f"orphan-{i}") for i in range(3)))

    for events in asyncio.run(run()):
        assert events[-1]["type"] == "error" and events[-1]["code"] == "worker_lost"
    assert len(reads) == 1, "one liveness read for all three quiet streams"
    for i in range(3):  # ending with an error also aborts the request
        assert r.exists(protocol.aborted_key(f"orphan-{i}"))


def test_a_burst_of_followers_wakes_the_blocked_reader_once_and_all_are_served(r):
    """Each wake makes the reader XREAD every followed stream again: one per joiner would be n^2."""

    async def run():
        idle = asyncio.create_task(collect("burst-idle"))
        await asyncio.sleep(0.2)  # the reader now blocks in XREAD
        hub = engine.aclient().hub
        wakes = []
        real_pipeline = hub.r.pipeline
        hub.r.pipeline = lambda *a, **k: wakes.append(1) or real_pipeline(*a, **k)
        for i in range(20):
            write(r, f"burst-{i}", DELTA, FINISH)
        started = time.monotonic()
        results = await asyncio.gather(*(collect(f"burst-{i}") for i in range(20)))
        waited = time.monotonic() - started
        hub.r.pipeline = real_pipeline
        write(r, "burst-idle", FINISH)
        await idle
        return results, len(wakes), waited

    results, wakes, waited = asyncio.run(run())
    assert all([e["type"] for e in events] == ["delta", "finish"] for events in results)
    assert wakes <= 2, f"{wakes} wakes for 20 followers"
    assert waited < 0.5, f"the burst waited {waited:.2f}s"


def test_a_follower_that_joins_behind_the_xread_in_flight_still_gets_every_entry(r):
    """A reconnecting tab follows a stream from its start while the hub's XREAD for that stream is in
    flight from a later id; the reply to that XREAD must not make the newcomer skip the entries before."""

    async def run():
        write(r, "rejoin", {**DELTA, "text": "a"})
        owner = await engine.aclient().hub.subscribe(protocol.output_stream("rejoin"), "0-0")
        assert [e["text"] for e in await owner.get()] == ["a"]
        await asyncio.sleep(0.1)  # the reader now blocks in XREAD from a's id
        write(r, "rejoin", {**DELTA, "text": "b"})  # that XREAD returns; the loop has not seen the reply yet
        replay = asyncio.create_task(collect("rejoin"))  # joins from 0-0 before the reply is handled
        await asyncio.sleep(0.1)
        write(r, "rejoin", FINISH)
        engine.aclient().hub.unsubscribe(protocol.output_stream("rejoin"), owner)
        return await replay

    events = asyncio.run(run())
    assert [e.get("text") for e in events] == ["a", "b", None]


def test_streams_quiet_for_half_a_second_are_named_only_in_the_cold_reads(r):
    """A flood's backlog waits in the engine's queue with nothing to read: naming each of its streams in
    every XREAD made each read walk them all. They are read every HUB_COLD_READ_S instead."""

    async def run():
        tasks = [asyncio.create_task(collect(f"backlog-{i}")) for i in range(3)]
        await asyncio.sleep(0.1)  # all three are followed now
        hub = engine.aclient().hub
        keys = [protocol.output_stream(f"backlog-{i}") for i in range(3)]
        now = time.monotonic()
        for key in keys:
            hub.touch(key, now)  # explicit clocks: followed just now
        hub.cold_read_at = now  # a cold read just happened
        assert set(hub.query(now)) == set(keys)  # followed within HUB_HOT_S: hot
        # each step past its threshold by a margin: (m + x) - m rounds below x for some clock values m
        now += protocol.HUB_HOT_S + 0.01
        hub.cold_read_at = now
        assert hub.query(now) == {} and not hub.hot  # quiet since, and the last cold read is fresh: none
        now += protocol.HUB_COLD_READ_S + 0.001
        assert set(hub.query(now)) == set(keys)  # the cold read names them all
        assert hub.query(now) == {}  # and then not again until the next
        hub.touch(keys[1], now)  # written to: hot again
        assert set(hub.query(now)) == {keys[1]}
        for i in range(3):  # a cold stream's events still arrive, from the next cold read
            write(r, f"backlog-{i}", DELTA, FINISH)
        return await asyncio.gather(*tasks)

    for events in asyncio.run(run()):
        assert [e["type"] for e in events] == ["delta", "finish"]


def test_a_worker_ringing_the_doorbell_gets_a_cold_stream_read_at_once(r, monkeypatch):
    """A stream that went quiet (its request waited in an engine's queue) is not named in the step-by-step
    XREADs; the worker that writes to it again rings its lease's doorbell, and the next XREAD names it. With
    cold reads turned off, the events arrive through the ring or not at all."""
    monkeypatch.setattr(protocol, "HUB_COLD_READ_S", 3600.0)

    async def run():
        task = asyncio.create_task(collect("quiet"))
        await asyncio.sleep(0.1)  # followed: the reader blocks in an XREAD that names it
        hub = engine.aclient().hub
        hub.hot[protocol.output_stream("quiet")] = time.monotonic() - 10  # it went quiet long ago
        r.xadd(hub.doorbell, {"w": "1"})  # the reader reads again, this time without it
        await asyncio.sleep(0.1)
        write(r, "quiet", DELTA, FINISH)
        await asyncio.sleep(0.3)
        unread = not task.done()
        r.xadd(hub.doorbell, protocol.ring_fields(["quiet"]))
        return unread, await asyncio.wait_for(task, 30)

    unread, events = asyncio.run(run())
    assert unread  # not named: without the ring it would wait for a cold read
    assert [e["type"] for e in events] == ["delta", "finish"]
