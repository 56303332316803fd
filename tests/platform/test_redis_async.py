"""common.redis_async: a task cancelled while redis-py writes really ends, on every loop turn of the
write. Stock redis-py connections lose such a cancellation on Python 3.11 (wait_for), which once
left a Channels consumer in its BZPOPMIN loop for ever and hung the test run."""

from __future__ import annotations

import asyncio
import sys
import threading

import pytest
import redis.asyncio as aioredis
from channels.layers import get_channel_layer
from django.conf import settings
from redis.exceptions import TimeoutError as RedisTimeoutError

from common import redis_async
from engine_client import client as engine

STEPS = 12  # loop turns to cancel after: from before the write starts to after it has finished


async def cancel_at_every_turn(connection_class) -> tuple[list[int], list[int]]:
    """(the loop turns at which a cancel found the writing task still running, those at which the
    task then carried on regardless)."""
    pool = aioredis.ConnectionPool(
        **{**redis_async.pool_kwargs(settings.REDIS_URL), "connection_class": connection_class}
    )
    connection = await pool.get_connection()
    landed, swallowed = [], []

    async def drain_over_turns():  # a socket write that takes a few loop turns, as a full buffer does
        for _ in range(3):
            await asyncio.sleep(0)

    try:
        for step in range(STEPS):
            connection._writer.drain = drain_over_turns
            task = asyncio.ensure_future(connection.send_command("PING"))
            for _ in range(step):
                await asyncio.sleep(0)
            if task.cancel() and step > 0:  # step 0: cancelled before it began
                landed.append(step)
            await asyncio.gather(task, return_exceptions=True)
            if step in landed and not task.cancelled():
                swallowed.append(step)
            await connection.disconnect()  # a fresh connection for the next step (no PONG left unread)
            await connection.connect()
    finally:
        await pool.disconnect()
    return landed, swallowed


def test_a_cancelled_write_always_ends_the_task():
    landed, swallowed = asyncio.run(cancel_at_every_turn(redis_async.CancelSafeConnection))
    assert len(landed) >= 2 and swallowed == []  # cancels did land mid-write, and every one ended it


@pytest.mark.skipif(sys.version_info >= (3, 12), reason="CPython 3.12 fixed wait_for")
def test_the_probe_catches_stock_redis_py_losing_the_cancellation():
    assert asyncio.run(cancel_at_every_turn(aioredis.Connection))[1] != []


@pytest.mark.parametrize(
    "url, expected",
    [
        ("redis://127.0.0.1:6379/0", redis_async.CancelSafeConnection),
        ("rediss://cache.example:6380/1", redis_async.CancelSafeSSLConnection),
        ("unix:///run/redis.sock?db=2", redis_async.CancelSafeUnixConnection),
    ],
)
def test_every_url_scheme_gets_its_cancel_safe_class(url, expected):
    kwargs = redis_async.pool_kwargs(url, socket_timeout=30)
    assert kwargs["connection_class"] is expected and kwargs["socket_timeout"] == 30
    assert issubclass(expected, aioredis.ConnectionPool.from_url(url).connection_class)


def test_a_write_past_its_timeout_is_a_redis_timeout_error():
    async def scenario():
        pool = aioredis.ConnectionPool(**redis_async.pool_kwargs(settings.REDIS_URL, socket_timeout=0.05))
        connection = await pool.get_connection()

        async def never_drains():  # a peer that stopped reading
            await asyncio.sleep(3600)

        connection._writer.drain = never_drains
        try:
            with pytest.raises(RedisTimeoutError, match="Timeout writing to socket"):
                await connection.send_command("PING")
            assert not connection.is_connected  # redis-py dropped the half-written connection
        finally:
            await pool.disconnect()

    asyncio.run(scenario())


def test_the_channel_layer_and_the_engine_client_use_cancel_safe_connections():
    async def classes():
        layer_pool = get_channel_layer().connection(0).connection_pool
        return layer_pool.connection_class, engine.aclient().r.connection_pool.connection_class

    assert asyncio.run(classes()) == (redis_async.CancelSafeConnection, redis_async.CancelSafeConnection)


async def leave_receivers(layer, count: int, delay: float) -> None:
    """What a test's event loop did: consumers still receiving when the loop ends (asyncio.run
    then cancels them)."""
    for _ in range(count):
        asyncio.ensure_future(layer.receive(await layer.new_channel()))
    await asyncio.sleep(delay)


def test_receives_cancelled_by_asyncio_run_never_hang_it():
    """The CI hang itself, loop after loop: with stock connections it hung within a few dozen."""
    layer = get_channel_layer()
    delays = [0, 0.0005, 0.002, 0.01, 0.03]

    def loops():
        for i in range(80):
            asyncio.run(leave_receivers(layer, 1 + i % 3, delays[i % len(delays)]))

    runner = threading.Thread(target=loops, daemon=True)  # daemon: a hang fails the test, not the run
    runner.start()
    runner.join(120)
    assert not runner.is_alive(), "asyncio.run waited for ever on a cancelled channel-layer receive"
    assert layer.receive_count == 0  # every receive ended
