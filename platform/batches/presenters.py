"""Model -> the exact JSON objects of OpenAI's Files and Batches APIs."""

from __future__ import annotations

from datetime import datetime

from .models import Batch, File


def unix(value: datetime | None) -> int | None:
    return None if value is None else int(value.timestamp())


def file_object(file: File) -> dict:
    return {
        "id": file.public_id,
        "object": "file",
        "bytes": file.bytes,
        "created_at": unix(file.created_at),
        "expires_at": unix(file.expires_at),
        "filename": file.filename,
        "purpose": file.purpose,
        "status": "processed",
        "status_details": None,
    }


def batch_errors(batch: Batch) -> dict | None:
    if not batch.errors:
        return None
    return {"object": "list", "data": batch.errors}


def batch_usage(batch: Batch) -> dict:
    return {
        "input_tokens": batch.input_tokens,
        "input_tokens_details": {"cached_tokens": batch.cached_tokens},
        "output_tokens": batch.output_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": batch.input_tokens + batch.output_tokens,
    }


def batch_object(batch: Batch) -> dict:
    return {
        "id": batch.public_id,
        "object": "batch",
        "endpoint": batch.endpoint,
        "errors": batch_errors(batch),
        "input_file_id": batch.input_file_public_id,
        "completion_window": batch.completion_window,
        "status": batch.status,
        "output_file_id": batch.output_file.public_id if batch.output_file_id else None,
        "error_file_id": batch.error_file.public_id if batch.error_file_id else None,
        "created_at": unix(batch.created_at),
        "in_progress_at": unix(batch.in_progress_at),
        "expires_at": unix(batch.expires_at),
        "finalizing_at": unix(batch.finalizing_at),
        "completed_at": unix(batch.completed_at),
        "failed_at": unix(batch.failed_at),
        "expired_at": unix(batch.expired_at),
        "cancelling_at": unix(batch.cancelling_at),
        "cancelled_at": unix(batch.cancelled_at),
        "request_counts": {"total": batch.total, "completed": batch.completed, "failed": batch.failed},
        "metadata": batch.metadata,
        "usage": batch_usage(batch),
        # Tessera's addition (ignored by OpenAI clients): why an in_progress batch is waiting.
        "paused_reason": batch.paused_reason or None,
    }


def list_object(items: list[dict], has_more: bool) -> dict:
    return {
        "object": "list",
        "data": items,
        "first_id": items[0]["id"] if items else None,
        "last_id": items[-1]["id"] if items else None,
        "has_more": has_more,
    }
