"""ws/dashboard/engine/: the live engine panel, one snapshot a second, staff only.

Each connection polls the workers' heartbeats itself (a cheap Redis read) rather than joining a
Channels group, so every web replica serves its own staff without a broadcaster process.
"""

from __future__ import annotations

import asyncio
import logging

from asgiref.sync import sync_to_async
from channels.generic.websocket import AsyncJsonWebsocketConsumer
from django.conf import settings

from . import live

log = logging.getLogger(__name__)


def is_staff(user) -> bool:
    return bool(user is not None and user.is_authenticated and user.is_active and user.is_staff)


class EngineLiveConsumer(AsyncJsonWebsocketConsumer):
    async def connect(self):
        if not is_staff(self.scope.get("user")):
            await self.close()  # before accept: the handshake is refused
            return
        await self.accept()
        self.ticker = asyncio.create_task(self._tick())

    async def disconnect(self, code):
        ticker = getattr(self, "ticker", None)
        if ticker is not None:
            ticker.cancel()

    async def _tick(self):
        interval = getattr(settings, "DASHBOARD_LIVE_INTERVAL_S", 1.0)
        while True:
            try:
                snapshot = await sync_to_async(live.engine_snapshot, thread_sensitive=False)()
                await self.send_json({"type": "engine", **snapshot})
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # Redis down for a moment: say so, keep the socket
                log.warning("dashboard engine snapshot failed: %s", exc)
                await self.send_json({"type": "error", "message": f"engine state unavailable: {exc}"})
            await asyncio.sleep(interval)
