"""Follow one reply's engine output stream: forward deltas to a socket, save as it goes, finish once.

The follower that started a reply (the owner) keeps running when its socket closes, so the answer is
still saved; if no socket watches the reply for RECONNECT_GRACE_S, it aborts the request in the
engine. A reconnecting socket starts a non-owner follower that replays the stream from its start
(the output stream stays in Redis until the message is saved).
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

from channels.db import database_sync_to_async
from django.conf import settings
from django.db import DatabaseError

from engine_client import client as engine

from . import services

log = logging.getLogger(__name__)

SAVE_EVERY_S = 0.5
RENEW_EVERY_S = 30.0
Send = Callable[[dict], Awaitable[None]]


def watch_key(message_id: int) -> str:
    return f"chat:watching:{message_id}"


def reconnect_grace_s() -> int:
    return int(getattr(settings, "CHAT_RECONNECT_GRACE_S", 20))


async def mark_watched(message_id: int) -> None:
    """A socket is showing this reply (refreshed by the consumer while it follows one)."""
    await engine.aclient().r.set(watch_key(message_id), "1", ex=reconnect_grace_s())


async def is_watched(message_id: int) -> bool:
    return bool(await engine.aclient().r.exists(watch_key(message_id)))


class Follower:
    """Reads a reply's events; `send` is swapped to a no-op when the socket goes away."""

    def __init__(self, message_id: int, request_id: str, model: str, send: Send | None, *, owner: bool,
                 arrived_at: float | None = None):
        self.message_id = message_id
        self.request_id = request_id
        self.model = model
        self.send = send
        self.owner = owner
        self.arrived_at = arrived_at or time.time()  # when the frame asking for this reply arrived
        self.text: list[str] = []
        self.completion_tokens = 0
        self.first_token_at: float | None = None
        self.outcome = services.Outcome(content="")
        self._last_save = time.monotonic()
        self._last_renew = time.monotonic()
        self._last_watch_check = time.monotonic()

    def detach(self) -> None:
        self.send = None

    async def _emit(self, frame: dict) -> None:
        if self.send is not None:
            try:
                await self.send(frame)
            except Exception:  # the socket closed under us; keep following for the save
                self.send = None

    async def run(self) -> None:
        try:
            async for event in engine.aclient().stream(self.request_id, model=self.model):
                await self._on_event(event)
        except Exception as exc:  # Redis gone, etc.: the message must not stay "streaming"
            log.exception("following %s failed", self.request_id)
            self.outcome.error, self.outcome.error_code = f"Streaming failed: {exc}", "stream_failed"
        await self.finish()

    async def _on_event(self, event: dict) -> None:
        kind = event["type"]
        if kind == "delta":
            await self._on_delta(event)
        elif kind == "finish":
            usage = event.get("usage") or {}
            reasons = event.get("finish_reasons") or []
            self.outcome.finish_reason = self.outcome.finish_reason or (reasons[0] if reasons else "") or ""
            self.outcome.prompt_tokens = usage.get("prompt_tokens")
            self.outcome.completion_tokens = usage.get("completion_tokens", self.completion_tokens)
            self.outcome.cached_tokens = usage.get("cached_tokens") or 0
            self.outcome.engine_ttft_ms = (event.get("metrics") or {}).get("ttft_ms")
        elif kind == "error":
            self.outcome.error = event.get("message") or "The engine failed."
            self.outcome.error_code = event.get("code", "engine_error")

    async def _on_delta(self, event: dict) -> None:
        text = event.get("text", "")
        if event.get("token_ids") and self.first_token_at is None:
            self.first_token_at = time.time()
        self.completion_tokens += len(event.get("token_ids") or [])
        self.outcome.completion_tokens = self.completion_tokens
        if event.get("finish_reason"):
            self.outcome.finish_reason = event["finish_reason"]
        if text:
            self.text.append(text)
            await self._emit({"type": "delta", "message_id": self.message_id, "text": text})
        if self.owner:
            await self._housekeeping()

    async def _housekeeping(self) -> None:
        now = time.monotonic()
        if now - self._last_save >= SAVE_EVERY_S:
            self._last_save = now
            await database_sync_to_async(services.save_progress)(self.message_id, "".join(self.text))
        if now - self._last_renew >= RENEW_EVERY_S:
            self._last_renew = now
            await database_sync_to_async(_renew_lease)(self.message_id)
        if self.send is None and now - self._last_watch_check >= 1.0:
            self._last_watch_check = now
            if not await is_watched(self.message_id):  # nobody came back: stop spending compute
                await engine.aclient().abort(self.request_id)

    async def finish(self) -> None:
        if not self.owner:  # the owner measured TTFT and latency: give it the first chance to save
            await self._wait_for_owner()
        self.outcome.content = "".join(self.text)
        if self.owner and self.first_token_at is not None:
            self.outcome.ttft_ms = round((self.first_token_at - self.arrived_at) * 1000, 1)
        if self.owner:
            self.outcome.latency_ms = round((time.time() - self.arrived_at) * 1000, 1)
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
        """finish_reply, retried: a transient database error must not leave the reply "streaming"."""
        for attempt in range(attempts):
            try:
                await database_sync_to_async(services.finish_reply)(self.message_id, self.outcome)
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


def _renew_lease(message_id: int) -> None:
    from quotas import services as quotas
    from quotas.ledger import Reservation

    from .models import Message

    message = Message.objects.filter(pk=message_id).only("reservation").first()
    if message and message.reservation:
        quotas.renew(Reservation.from_dict(message.reservation))


def _payload(message_id: int) -> dict | None:
    from .models import Message
    from .selectors import message_payload

    message = Message.objects.filter(pk=message_id).first()
    return message_payload(message) if message else None
