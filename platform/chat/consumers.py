"""The playground websocket: an adapter turning the generation service's events into frames.

chat.services begins a reply (and admits its generation), streaming.ReplyRelay relays it to the socket;
the engine is reached only through the generation service.

Client -> server frames: {"type": "send", "conversation_id"?, "content", "settings"} |
{"type": "edit", "message_id", "content", "settings"} | {"type": "regenerate", "message_id", "settings"} |
{"type": "stop"} | {"type": "resume", "message_id"} | {"type": "select_branch", "conversation_id", "message_id"}.
settings = {"model", "system_prompt", "params": {temperature, top_p, max_tokens, seed, stop,
presence_penalty, frequency_penalty}}.
Server -> client: ready, started, delta {message_id, text}, done {message}, branch {messages}, error
{code, message, retry_after?}. Protocol notes in docs/playground.md.
"""

from __future__ import annotations

import asyncio
import json
import time

from channels.db import database_sync_to_async
from channels.generic.websocket import AsyncJsonWebsocketConsumer

from errors import QuotaExceeded, ServiceError
from generation import services as generation

from . import prompting, selectors, services, streaming
from .models import Message

WATCH_REFRESH_S = 5.0
_background: set[asyncio.Task] = set()  # strong references: replies outlive their socket


def error_frame(error: ServiceError) -> dict:
    """The websocket rendering of any ServiceError (a refused quota adds when to retry)."""
    frame = {"type": "error", "code": error.code, "message": error.message}
    if isinstance(error, QuotaExceeded):
        frame["retry_after"] = error.retry_after
    return frame


def _spawn(coro) -> asyncio.Task:
    task = asyncio.create_task(coro)
    _background.add(task)
    task.add_done_callback(_background.discard)
    return task


class PlaygroundConsumer(AsyncJsonWebsocketConsumer):
    async def connect(self):
        self.user = self.scope.get("user")
        if self.user is None or not self.user.is_authenticated:
            await self.close(code=4401)
            return
        self.relay: streaming.ReplyRelay | None = None
        self.relay_task: asyncio.Task | None = None
        self.watch_task: asyncio.Task | None = None
        await self.accept()
        await self.send_json({"type": "ready", "model": prompting.served_model_name()})

    async def disconnect(self, code):
        if getattr(self, "relay", None) is not None:
            self.relay.detach()  # the owner keeps saving; the watch key lapses unless we come back
        if getattr(self, "watch_task", None) is not None:
            self.watch_task.cancel()

    @classmethod
    async def decode_json(cls, text_data):
        try:
            return json.loads(text_data)
        except ValueError:
            return None

    async def receive_json(self, content, **kwargs):
        if not isinstance(content, dict):
            await self.send_error(ServiceError("Frames are JSON objects.", code="bad_frame"))
            return
        handler = {
            "send": self.on_send,
            "edit": self.on_edit,
            "regenerate": self.on_regenerate,
            "stop": self.on_stop,
            "resume": self.on_resume,
            "select_branch": self.on_select_branch,
        }.get(content.get("type"))
        if handler is None:
            await self.send_error(ServiceError("Unknown frame type.", code="bad_frame"))
            return
        await handler(content)

    async def send_error(self, error: ServiceError) -> None:
        await self.send_json(error_frame(error))

    # ------------------------------------------------------------ starting replies

    def _busy(self) -> bool:
        return self.relay_task is not None and not self.relay_task.done()

    async def on_send(self, frame):
        conversation_id = frame.get("conversation_id")

        def begin():
            conversation = None
            if conversation_id:
                conversation = selectors.conversation_for(self.user, conversation_id)
                if conversation is None:
                    raise services.ChatError("Conversation not found.", code="not_found")
            return services.send_message(
                self.user, frame.get("content"), frame.get("settings") or {}, conversation, arrived_at=arrived_at
            )

        arrived_at = time.time()  # TTFT and latency count from here, as the user waits
        await self._start(begin)

    async def on_edit(self, frame):
        def begin():
            message = self._own_message(frame.get("message_id"))
            return services.edit_message(
                self.user, message, frame.get("content"), frame.get("settings") or {}, arrived_at=arrived_at
            )

        arrived_at = time.time()
        await self._start(begin)

    async def on_regenerate(self, frame):
        def begin():
            message = self._own_message(frame.get("message_id"))
            return services.regenerate(self.user, message, frame.get("settings") or {}, arrived_at=arrived_at)

        arrived_at = time.time()
        await self._start(begin)

    def _own_message(self, message_id) -> Message:
        message = selectors.message_for(self.user, message_id)
        if message is None:
            raise services.ChatError("Message not found.", code="not_found")
        return message

    async def _start(self, begin) -> None:
        if self._busy():
            await self.send_error(ServiceError("An answer is still being generated; stop it first.", code="busy"))
            return
        try:
            reply = await database_sync_to_async(begin)()
        except ServiceError as error:
            await self.send_error(error)
            return
        await self.send_json(await database_sync_to_async(selectors.reply_started_payload)(reply))
        relay = streaming.ReplyRelay(reply.message_id, reply.gen, self.send_json, owner=True)
        try:
            await generation.asubmit(reply.gen)
        except Exception as exc:  # Redis unreachable: nothing was queued
            relay.fail("submit_failed", f"Could not queue the request: {exc}")
            await relay.finish()
            return
        self._relay(relay)

    def _relay(self, relay: streaming.ReplyRelay) -> None:
        self.relay = relay
        self.relay_task = _spawn(relay.run())
        if self.watch_task is not None:
            self.watch_task.cancel()
        self.watch_task = asyncio.create_task(self._keep_watching(relay))

    async def _keep_watching(self, relay: streaming.ReplyRelay) -> None:
        """Tell the reply's owner that a socket still shows it (so it is not aborted as abandoned)."""
        while not self.relay_task.done():
            await streaming.mark_watched(relay.message_id)
            await asyncio.sleep(min(WATCH_REFRESH_S, streaming.reconnect_grace_s() / 3))

    # ------------------------------------------------------------ stop, resume, branches

    async def on_stop(self, frame):
        message_id = frame.get("message_id") or (self.relay.message_id if self.relay else None)

        def streaming_generation():
            message = selectors.message_for(self.user, message_id)
            if message is None or message.status != Message.Status.STREAMING:
                return None
            return services.generation_for(message)

        gen = await database_sync_to_async(streaming_generation)()
        if gen is None:
            await self.send_error(ServiceError("Nothing is being generated.", code="not_streaming"))
            return
        await generation.abort(gen)  # the stream then ends with finish_reason "abort"

    async def on_resume(self, frame):
        """After a reload or dropped socket: replay the reply from the start of its output stream."""
        message = await database_sync_to_async(selectors.message_for)(self.user, frame.get("message_id"))
        if message is None:
            await self.send_error(ServiceError("Message not found.", code="not_found"))
            return
        if message.status != Message.Status.STREAMING:
            await self.send_json(
                {"type": "done", "message": await database_sync_to_async(selectors.message_payload)(message)}
            )
            return
        if self._busy():
            await self.send_error(ServiceError("Already following an answer.", code="busy"))
            return
        await self.send_json({"type": "resumed", "message_id": message.pk})
        gen = await database_sync_to_async(services.generation_for)(message)
        self._relay(streaming.ReplyRelay(message.pk, gen, self.send_json, owner=False))

    async def on_select_branch(self, frame):
        def select():
            message = self._own_message(frame.get("message_id"))
            conversation = services.select_branch(message.conversation, message)
            return selectors.current_branch(conversation)

        try:
            branch = await database_sync_to_async(select)()
        except ServiceError as error:
            await self.send_error(error)
            return
        await self.send_json({"type": "branch", "messages": branch})
