"""The web process's ASGI handler frees each request by reference counts. uvicorn reports a client
disconnect to the application once a response is complete; Django's disconnect listener raised
RequestAborted then, and handle() re-raising it held its own frame in the traceback, whose tasks held
the exception: every streamed request's objects in a cycle that only the collector frees, in pauses that
grow with the streams open (docs/benchmarks.md, Fair share)."""

from __future__ import annotations

import asyncio
import gc

import pytest
from django.core.exceptions import RequestAborted
from django.core.handlers.asgi import ASGIRequest

from tests.platform.security.asgi_calls import BASE_SCOPE

pytestmark = pytest.mark.django_db(transaction=True)

SCOPE = {**BASE_SCOPE, "path": "/metrics", "raw_path": b"/metrics"}


async def as_uvicorn_calls() -> int:
    """One request; receive() answers http.disconnect as soon as the response is complete, as uvicorn's does."""
    from tessera.asgi import application

    complete, sent = asyncio.Event(), []
    messages = [{"type": "http.request", "body": b"", "more_body": False}]

    async def receive():
        if messages:
            return messages.pop(0)
        await complete.wait()
        return {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)
        if message["type"] == "http.response.body" and not message.get("more_body"):
            complete.set()
            await asyncio.sleep(0)  # the listener runs before the response's task ends, as under load

    await application(dict(SCOPE), receive, send)
    return next(m["status"] for m in sent if m["type"] == "http.response.start")


def test_a_request_whose_client_disconnects_after_the_response_leaves_no_cycle():
    assert asyncio.run(as_uvicorn_calls()) == 200  # imports and caches warm
    gc.collect()
    gc.disable()
    gc.set_debug(gc.DEBUG_SAVEALL)  # what a collection finds unreachable stays in gc.garbage to be looked at
    try:
        status = asyncio.run(as_uvicorn_calls())
        gc.collect()
        left = [type(o).__name__ for o in gc.garbage if isinstance(o, ASGIRequest | RequestAborted)]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()
    assert status == 200
    assert left == []
