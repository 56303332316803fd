"""tessera.redis_async: a task cancelled while redis-py writes really ends, on every loop turn of the
write. Stock redis-py connections lose such a cancellation on Python 3.11 (wait_for), which once
left a Channels consumer in its BZPOPMIN loop for ever and hung the test run."""
from __future__ import annotations

import asyncio
import sys

import pytest
import redis.asyncio as aioredis
from channels.layers import get_channel_layer
from django.conf import settings
from redis.exceptions import TimeoutError as RedisTimeoutError

from engine_client import client as engine
from tessera import redis_async

STEPS = 12  # loop turns to cancel after: from before the write starts to after it has finished


async def swallowed_steps(connection_class) -> list[int]:
    """The loop turns at which cancelling a task in a write let the task carry on."""
    pool = aioredis.ConnectionPool(**{**redis_async.pool_kwargs(settings.REDIS_URL), "connection_class": connection_class})
    connection = await pool.get_connection()
    swallowed = []
    try:
        for step in range(STEPS):
            carried_on = []

            async def write():
                await connection.send_command("PING")
                carried_on.append(step)

            task = asyncio.ensure_future(write())
            for _ in range(step):
                await asyncio.sleep(0)
            cancelled = task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            if cancelled and not task.cancelled():
                swallowed.append(step)
            await connection.disconnect()  # a fresh connection for the next step (no PONG left unread)
            await connection.connect()
    finally:
        await pool.disconnect()
    return swallowed


def test_a_cancelled_write_always_ends_the_task():
    assert asyncio.run(swallowed_steps(redis_async.CancelSafeConnection)) == []


@pytest.mark.skipif(sys.version_info >= (3, 12), reason="CPython 3.12 fixed wait_for")
def test_the_probe_catches_stock_redis_py_losing_the_cancellation():
    assert asyncio.run(swallowed_steps(aioredis.Connection)) != []


@pytest.mark.parametrize("url, expected", [
    ("redis://127.0.0.1:6379/0", redis_async.CancelSafeConnection),
    ("rediss://cache.example:6380/1", redis_async.CancelSafeSSLConnection),
    ("unix:///run/redis.sock?db=2", redis_async.CancelSafeUnixConnection)])
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
