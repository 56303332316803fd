"""Relay one reply's generation to its socket: forward deltas, save as it goes, finish once.

The relay that started a reply (the owner) keeps running when its socket closes, so the answer is
still saved; if no socket watches the reply for RECONNECT_GRACE_S, it aborts the generation
(generation.abort). A reconnecting socket starts a non-owner relay that replays the stream from its
start (the output stream stays in Redis until the message is saved). Everything asked of the engine
goes through the generation service; the watch keys are chat's own, on common.connections.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

from channels.db import database_sync_to_async
from django.conf import settings
from django.db import DatabaseError

from common import connections
from generation import services as generation
from generation.services import Generation

from . import services

log = logging.getLogger(__name__)

SAVE_EVERY_S = 0.5
Send = Callable[[dict], Awaitable[None]]


def watch_key(message_id: int) -> str:
    return f"chat:watching:{message_id}"


def reconnect_grace_s() -> int:
    return int(getattr(settings, "CHAT_RECONNECT_GRACE_S", 20))


async def mark_watched(message_id: int) -> None:
    """A socket is showing this reply (refreshed by the consumer while it relays one)."""
    await connections.async_redis().set(watch_key(message_id), "1", ex=reconnect_grace_s())


async def is_watched(message_id: int) -> bool:
    return bool(await connections.async_redis().exists(watch_key(message_id)))


class ReplyRelay:
    """Relays one reply's generation to a socket; `send` is swapped to a no-op when the socket goes away."""

    def __init__(self, message_id: int, gen: Generation, send: Send | None, *, owner: bool):
        self.message_id = message_id
        self.gen = gen
        self.send = send
        self.owner = owner
        self._last_save = time.monotonic()
        self._last_watch_check = time.monotonic()

    def detach(self) -> None:
        self.send = None

    async def _emit(self, frame: dict) -> None:
        if self.send is not None:
            try:
                await self.send(frame)
            except Exception:  # the socket closed under us; keep relaying for the save
                self.send = None

    async def run(self) -> None:
        try:
            async for event in generation.follow(self.gen):
                if event["type"] == "delta":
                    await self._on_delta(event)
        except Exception as exc:  # Redis gone, etc.: the message must not stay "streaming"
            log.exception("relaying %s failed", self.gen.request_id)
            self.fail("stream_failed", f"Streaming failed: {exc}")
        await self.finish()

    def fail(self, code: str, message: str) -> None:
        self.gen.fail(500, code)
        self.gen.result.error = {"code": code, "message": message}

    async def _on_delta(self, event: dict) -> None:
        if event.get("text"):
            await self._emit({"type": "delta", "message_id": self.message_id, "text": event["text"]})
        if self.owner:
            await self._housekeeping()

    async def _housekeeping(self) -> None:
        now = time.monotonic()
        if now - self._last_save >= SAVE_EVERY_S:
            self._last_save = now
            await database_sync_to_async(services.save_progress)(self.message_id, self.gen.result.text)
        if self.send is None and now - self._last_watch_check >= 1.0:
            self._last_watch_check = now
            if not await is_watched(self.message_id):  # nobody came back: stop spending compute
                await generation.abort(self.gen)

    async def finish(self) -> None:
        if not self.owner:  # the owner holds the reservation: give it the first chance to save
            await self._wait_for_owner()
        try:
            await self._save_final()
        except Exception as exc:  # the socket must still hear how the answer ended
            log.exception("saving reply %s failed", self.message_id)
            await self._emit({"type": "error", "code": "save_failed", "message": f"Could not save the answer: {exc}"})
            return
        payload = await database_sync_to_async(_payload)(self.message_id)
        if payload is not None:
            await self._emit({"type": "done", "message": payload})

    async def _save_final(self, attempts: int = 3) -> None:
        """The generation's finish, retried: a transient database error must not leave the reply "streaming"."""
        for attempt in range(attempts):
            try:
                # the consumer's own database thread: its other reads and writes of this reply run there too
                await database_sync_to_async(services.finish_reply)(self.message_id, self.gen)
                return
            except DatabaseError:
                if attempt == attempts - 1:
                    raise
                log.warning("saving reply %s failed; retrying", self.message_id, exc_info=True)
                await asyncio.sleep(0.2 * (attempt + 1))

    async def _wait_for_owner(self, timeout_s: float = 3.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not await database_sync_to_async(_is_streaming)(self.message_id):
                return
            await asyncio.sleep(0.1)


def _is_streaming(message_id: int) -> bool:
    from .models import Message

    return Message.objects.filter(pk=message_id, status=Message.Status.STREAMING).exists()


def _payload(message_id: int) -> dict | None:
    from .models import Message
    from .selectors import message_payload

    message = Message.objects.filter(pk=message_id).first()
    return message_payload(message) if message else None
