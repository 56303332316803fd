"""Reads: a user's files and batches (another user's objects are simply not found), pages, due work."""

from __future__ import annotations

from datetime import datetime

from django.db.models import Q, QuerySet

from errors import InvalidRequest, NotFound

from .models import Batch, BatchLine, File

MAX_PAGE = 100


def page_limit(raw, default: int = 20, maximum: int = MAX_PAGE) -> int:
    if raw in (None, ""):
        return default
    try:
        value = int(raw)
    except (TypeError, ValueError):
        raise InvalidRequest("limit must be an integer.", code="invalid_value", param="limit") from None
    if not 1 <= value <= maximum:
        raise InvalidRequest(f"limit must be between 1 and {maximum}.", code="invalid_value", param="limit")
    return value


def get_file(user, file_id: str) -> File:
    file = File.objects.filter(user=user, public_id=file_id).first()
    if file is None:
        raise NotFound(f"No such File object: {file_id}", param="file_id")
    return file


def get_batch(user, batch_id: str) -> Batch:
    batch = Batch.objects.select_related("output_file", "error_file").filter(user=user, public_id=batch_id).first()
    if batch is None:
        raise NotFound(f"No such batch: {batch_id}", param="batch_id")
    return batch


def _cursor_page(qs: QuerySet, after: str | None, limit: int, descending: bool) -> tuple[list, bool]:
    """Cursor pagination by the public id of the last item seen (OpenAI's `after`)."""
    if after:
        anchor = qs.filter(public_id=after).values_list("pk", flat=True).first()
        if anchor is None:
            raise InvalidRequest(f"No such object for after={after!r}.", code="invalid_value", param="after")
        qs = qs.filter(pk__lt=anchor) if descending else qs.filter(pk__gt=anchor)
    qs = qs.order_by("-pk" if descending else "pk")
    items = list(qs[: limit + 1])
    return items[:limit], len(items) > limit


def files_page(
    user, *, purpose: str | None = None, after: str | None = None, limit: int = 20, order: str = "desc"
) -> tuple[list[File], bool]:
    if order not in ("asc", "desc"):
        raise InvalidRequest("order must be 'asc' or 'desc'.", code="invalid_value", param="order")
    qs = File.objects.filter(user=user).defer("content")
    if purpose:
        qs = qs.filter(purpose=purpose)
    return _cursor_page(qs, after, limit, descending=order == "desc")


def batches_page(user, *, after: str | None = None, limit: int = 20) -> tuple[list[Batch], bool]:
    qs = Batch.objects.filter(user=user).select_related("output_file", "error_file")
    return _cursor_page(qs, after, limit, descending=True)


def recent_batches(user, limit: int = 50) -> list[Batch]:
    return list(
        Batch.objects.filter(user=user)
        .select_related("output_file", "error_file", "input_file")
        .order_by("-pk")[:limit]
    )


def batch_files(user, limit: int = 50) -> list[File]:
    return list(File.objects.filter(user=user, purpose=File.Purpose.BATCH).defer("content").order_by("-pk")[:limit])


def pending_lines(batch_id: int, limit: int) -> list[BatchLine]:
    return list(
        BatchLine.objects.filter(batch_id=batch_id, status=BatchLine.Status.PENDING).order_by("line_number")[:limit]
    )


def has_unfinished_lines(batch_id: int) -> bool:
    return BatchLine.objects.filter(batch_id=batch_id, status__in=BatchLine.UNFINISHED).exists()


def finished_lines(batch_id: int, statuses) -> QuerySet:
    return (
        BatchLine.objects.filter(batch_id=batch_id, status__in=statuses)
        .order_by("line_number")
        .only("line_number", "custom_id", "result_id", "response_status", "response_body", "error", "engine_request_id")
    )


def stalled_batches(now: datetime) -> list[int]:
    """Unfinished batches whose runner is gone (no live lease) and that are not resting on a pause."""
    live = Batch.objects.filter(status__in=[Batch.Status.IN_PROGRESS, Batch.Status.CANCELLING, Batch.Status.FINALIZING])
    free = Q(lease_until__isnull=True) | Q(lease_until__lt=now)
    resting = Q(resume_after__gt=now) & Q(expires_at__gt=now)
    return list(live.filter(free).exclude(resting).values_list("pk", flat=True))


def stuck_validations(older_than: datetime, now: datetime) -> list[int]:
    return list(
        Batch.objects.filter(status=Batch.Status.VALIDATING, created_at__lt=older_than)
        .exclude(resume_after__gt=now)
        .values_list("pk", flat=True)
    )


def overdue_batches(now: datetime) -> list[int]:
    return list(Batch.objects.filter(status=Batch.Status.VALIDATING, expires_at__lte=now).values_list("pk", flat=True))


def expired_files(now: datetime) -> QuerySet:
    return File.objects.filter(expires_at__lte=now)
