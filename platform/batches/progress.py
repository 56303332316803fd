"""Coarse batch progress over a Channels group (one event per status change or at most every
BATCH_PROGRESS_INTERVAL seconds while lines finish; never per token)."""

from __future__ import annotations

import logging

from asgiref.sync import async_to_sync
from channels.layers import get_channel_layer

log = logging.getLogger(__name__)


def group_name(public_id: str) -> str:
    return f"batch.{public_id}"


def snapshot(batch_id: int) -> tuple[str, dict] | None:
    from .models import Batch
    from .presenters import batch_object

    batch = Batch.objects.select_related("output_file", "error_file").filter(pk=batch_id).first()
    return None if batch is None else (batch.public_id, batch_object(batch))


def push(batch_id: int) -> None:
    """Send the batch's current object to its group. Best effort: progress is also readable by GET."""
    current = snapshot(batch_id)
    layer = get_channel_layer()
    if current is None or layer is None:
        return
    public_id, data = current
    try:
        async_to_sync(layer.group_send)(group_name(public_id), {"type": "batch.progress", "batch": data})
    except Exception:  # a channel layer hiccup must never fail the batch itself
        log.warning("batch progress push failed for %s", public_id, exc_info=True)
