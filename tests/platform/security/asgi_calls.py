"""Requests through the real ASGI application (tessera.asgi: the lean API handler for /v1), in process."""

from __future__ import annotations

import asyncio

import httpx
import redis
from django.conf import settings

BASE_SCOPE = {  # a GET of / as the web server hands it over; callers override what they need
    "type": "http",
    "asgi": {"version": "3.0"},
    "http_version": "1.1",
    "method": "GET",
    "scheme": "http",
    "path": "/",
    "raw_path": b"/",
    "query_string": b"",
    "root_path": "",
    "headers": [],
    "client": ("127.0.0.1", 50000),
    "server": ("127.0.0.1", 8000),
}


def call(method: str, path: str, **kwargs) -> httpx.Response:
    """One request through tessera.asgi.application, as the web server hands it over."""
    return asyncio.run(_call(method, path, **kwargs))


async def _call(method, path, **kwargs):
    from tessera.asgi import application

    transport = httpx.ASGITransport(app=application, client=("127.0.0.1", 50000))
    async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as client:
        return await client.request(method, path, **kwargs)


def raw_call(scope_overrides: dict, body_chunks: list[bytes], unread: list | None = None) -> tuple[int, dict, bytes]:
    """A hand-made ASGI scope (bytes no HTTP client would send) -> (status, headers, body).

    `unread`, when given, gets the body chunks the application never asked for."""
    return asyncio.run(_raw_call(scope_overrides, body_chunks, unread if unread is not None else []))


async def _raw_call(scope_overrides, body_chunks, unread):
    from tessera.asgi import application

    scope = {**BASE_SCOPE, **scope_overrides}
    messages = [
        {"type": "http.request", "body": chunk, "more_body": i < len(body_chunks) - 1}
        for i, chunk in enumerate(body_chunks or [b""])
    ]
    sent, finished = [], asyncio.Event()

    async def receive():
        if messages:
            return messages.pop(0)
        await finished.wait()  # Django treats an early disconnect as the client going away
        return {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)

    try:
        await application(scope, receive, send)
    finally:
        finished.set()
        unread.extend(messages)
    start = next(m for m in sent if m["type"] == "http.response.start")
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return start["status"], {k.decode().lower(): v.decode() for k, v in start["headers"]}, body


def is_envelope(body: dict) -> bool:
    return set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}


def no_engine_workers() -> None:
    """Forget every engine worker of the session's Redis, so generation answers 503 at once."""
    client = redis.Redis.from_url(settings.REDIS_URL)
    keys = list(client.scan_iter("tessera:engine:*", count=1000))
    if keys:
        client.delete(*keys)
