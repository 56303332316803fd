"""One owner for Redis connections: common.connections builds every client the apps use."""

from __future__ import annotations

import ast
import asyncio
from pathlib import Path

from common import connections
from engine_client import client as engine
from quotas.selectors import get_ledger

PLATFORM = Path(__file__).resolve().parents[2] / "platform"
CLIENT_BUILDERS = {"Redis", "StrictRedis", "from_url", "ConnectionPool", "BlockingConnectionPool"}
OUTSIDE_THE_APPS = {"common", "tessera"}  # the owner, and the project's pre-Django processes (run, healthcheck)


def redis_clients_built(path: Path) -> list[int]:
    """Lines of path that build a Redis client or pool (redis.Redis(...), Redis.from_url(...), ...)."""
    lines = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            if name in CLIENT_BUILDERS:
                lines.append(node.lineno)
    return lines


def test_no_app_builds_a_redis_client_of_its_own():
    found = {
        str(path.relative_to(PLATFORM)): lines
        for path in PLATFORM.rglob("*.py")
        if "migrations" not in path.parts
        and path.relative_to(PLATFORM).parts[0] not in OUTSIDE_THE_APPS
        and (lines := redis_clients_built(path))
    }
    assert redis_clients_built(PLATFORM / "common" / "connections.py"), "the scan sees the owner's own clients"
    assert found == {}


def test_the_engine_client_and_the_quota_ledger_share_the_processs_connection():
    assert engine.client().r is connections.sync_redis()
    assert get_ledger().redis is connections.sync_redis()


def test_each_event_loop_has_one_async_connection_shared_by_the_engine_client():
    async def clients():
        return connections.async_redis(), engine.aclient().r, connections.async_redis()

    first_loop, same_loop, again = asyncio.run(clients())
    other_loop, _, _ = asyncio.run(clients())
    assert first_loop is same_loop is again
    assert other_loop is not first_loop  # asyncio connections cannot cross loops
