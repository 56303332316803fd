"""Live progress of one batch: the page subscribes to the batch's group and gets coarse updates."""

from __future__ import annotations

from channels.db import database_sync_to_async
from channels.generic.websocket import AsyncJsonWebsocketConsumer

from errors import NotFound

from . import presenters, selectors
from .progress import group_name


class BatchProgressConsumer(AsyncJsonWebsocketConsumer):
    async def connect(self):
        user = self.scope.get("user")
        if user is None or not user.is_authenticated:
            await self.close(code=4401)
            return
        batch = await database_sync_to_async(self._batch)(user, self.scope["url_route"]["kwargs"]["batch_id"])
        if batch is None:
            await self.close(code=4404)  # another user's batch looks exactly like a missing one
            return
        self.group = group_name(batch["id"])
        await self.channel_layer.group_add(self.group, self.channel_name)
        await self.accept()
        await self.send_json(batch)  # the state now; the group carries every change after this

    @staticmethod
    def _batch(user, batch_id: str) -> dict | None:
        try:
            return presenters.batch_object(selectors.get_batch(user, batch_id))
        except NotFound:
            return None

    async def disconnect(self, code):
        if getattr(self, "group", None):
            await self.channel_layer.group_discard(self.group, self.channel_name)

    async def batch_progress(self, event):
        await self.send_json(event["batch"])
