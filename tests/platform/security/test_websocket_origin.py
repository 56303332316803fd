"""The websockets accept only pages of this site: a cross-site page (or none) cannot open one with the
user's cookie. Against a live web server whose ALLOWED_HOSTS are set as in a deployment.
"""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from tests.platform.security.live_web import Server

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    running = Server(tmp_path_factory.mktemp("origin"), DEBUG="0", ALLOWED_HOSTS="127.0.0.1,localhost")
    running.start()
    yield running
    running.stop()


async def _open(server: Server, origin: str | None, cookie: str) -> int | dict:
    """The first frame on success, else the handshake's HTTP status."""
    headers = {"Cookie": cookie, **({"Origin": origin} if origin is not None else {})}
    async with aiohttp.ClientSession() as session:
        try:
            async with session.ws_connect(
                f"ws://127.0.0.1:{server.port}/ws/chat/", headers=headers, timeout=aiohttp.ClientWSTimeout(ws_close=10)
            ) as ws:
                return await ws.receive_json(timeout=10)
        except aiohttp.WSServerHandshakeError as refused:
            return refused.status


def test_this_sites_origin_opens_the_socket(server):
    frame = asyncio.run(_open(server, f"http://127.0.0.1:{server.port}", server.session_cookie()))
    assert isinstance(frame, dict) and frame["type"] == "ready"


@pytest.mark.parametrize("origin", ["http://evil.example", "null", "http://127.0.0.1.evil.example", None])
def test_another_origin_is_refused_even_with_the_users_cookie(server, origin):
    assert asyncio.run(_open(server, origin, server.session_cookie())) == 403
