"""This process's Redis connections, built here and nowhere else.

    connections.sync_redis()    redis-py client (threads: views, services, Celery tasks, the engine worker)
    connections.async_redis()   the running event loop's asyncio client (consumers, async views, streams)
    connections.broker_redis()  the Celery broker's Redis (queue lengths for /metrics)

The engine client, the quota ledger, the log-in throttle, chat's watch keys, the credential cache and
/metrics all share these, so one process holds one pool per Redis (and per event loop), whoever asks.
redis-py pools notice a fork and start afresh, so a Celery worker's children need nothing of their own.
"""

from __future__ import annotations

import asyncio
import weakref

import redis
import redis.asyncio as aioredis
from django.conf import settings

from .redis_async import pool_kwargs

# redis-py's asyncio pool refuses the 101st concurrent command at once (MaxConnectionsError): a burst
# of 250 streams on one web process got 503s. This pool makes a burst wait for a free connection.
ASYNC_POOL_CONNECTIONS = 512
ASYNC_POOL_WAIT_S = 20

# Keyed by URL: a test (or a command) that points settings.REDIS_URL elsewhere gets a client for it.
_sync: dict[str, redis.Redis] = {}
_by_loop: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[str, aioredis.Redis]] = weakref.WeakKeyDictionary()


def sync_redis() -> redis.Redis:
    return _sync_for(settings.REDIS_URL)


def broker_redis() -> redis.Redis:
    return _sync_for(settings.CELERY_BROKER_URL)


def _sync_for(url: str) -> redis.Redis:
    found = _sync.get(url)
    if found is None:
        found = _sync[url] = redis.Redis.from_url(url)
    return found


def async_redis() -> aioredis.Redis:
    """The running event loop's client (asyncio connections cannot cross loops)."""
    clients = _by_loop.setdefault(asyncio.get_running_loop(), {})
    url = settings.REDIS_URL
    found = clients.get(url)
    if found is None:
        found = clients[url] = aioredis.Redis(connection_pool=_async_pool(url))
    return found


def _async_pool(url: str) -> aioredis.BlockingConnectionPool:
    """Cancel-safe connections (redis_async): a cancelled stream or lease task really stops."""
    return aioredis.BlockingConnectionPool(
        **pool_kwargs(url, max_connections=ASYNC_POOL_CONNECTIONS, timeout=ASYNC_POOL_WAIT_S)
    )
