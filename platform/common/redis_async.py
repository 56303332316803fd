"""redis-py asyncio connections whose cancellation always lands (Python 3.11).

redis-py bounds every socket write with asyncio.wait_for(write, socket_timeout). On Python 3.11,
wait_for swallows a cancellation that arrives in the loop turn the write finishes in (CPython
gh-86296, fixed in 3.12): the cancelled task runs on as if nothing happened. A Channels consumer
cancelled there stays in channels_redis's BZPOPMIN loop for ever, and asyncio.run then waits on it
for ever (a test run hung so in CI); the engine client's lease keeper would do the same.

These connections bound the write with asyncio.timeout instead, which counts cancellations right.
Both the channel layer and the engine client build their pools from pool_kwargs(url).
"""

from __future__ import annotations

import asyncio

import redis.asyncio as aioredis
from redis.asyncio.connection import AbstractConnection, parse_url
from redis.exceptions import TimeoutError as RedisTimeoutError


class CancelSafeWrites(AbstractConnection):
    """Mixed in before a redis-py connection class (a base here so the override is checked against it)."""

    async def send_packed_command(self, command, check_health: bool = True) -> None:
        timeout = self.socket_timeout
        if not timeout:
            return await super().send_packed_command(command, check_health)
        try:
            async with asyncio.timeout(timeout):
                # Without a socket timeout redis-py writes without wait_for; the health check's
                # read inside is bounded by this same timeout. One command owns a pooled
                # connection at a time, so nothing else reads the attribute meanwhile.
                self.socket_timeout = None
                try:
                    await super().send_packed_command(command, check_health)
                finally:
                    self.socket_timeout = timeout
        except TimeoutError:  # redis-py has disconnected already (its BaseException branch)
            raise RedisTimeoutError("Timeout writing to socket") from None


class CancelSafeConnection(CancelSafeWrites, aioredis.Connection):
    pass


class CancelSafeSSLConnection(CancelSafeWrites, aioredis.SSLConnection):
    pass


class CancelSafeUnixConnection(CancelSafeWrites, aioredis.UnixDomainSocketConnection):
    pass


def pool_kwargs(url: str, **options) -> dict:
    """A pool's keyword arguments for this URL with the cancel-safe connection class of its scheme
    (ConnectionPool.from_url would let the URL's own class win for rediss:// and unix://)."""
    kwargs = {**parse_url(url), **options}
    unsafe = kwargs.get("connection_class", aioredis.Connection)
    kwargs["connection_class"] = {
        aioredis.SSLConnection: CancelSafeSSLConnection,
        aioredis.UnixDomainSocketConnection: CancelSafeUnixConnection,
    }.get(unsafe, CancelSafeConnection)
    return kwargs
