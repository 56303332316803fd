"""Writes: files, batch creation and validation, line results (exactly once), cancel, finalize, expiry.

Celery tasks and the runner call these; every state change is a conditional UPDATE on the current
status, so two processes racing on one batch (a redelivered task, the watchdog, a cancel) cannot
both move it.
"""

from __future__ import annotations

import json
import secrets
from datetime import timedelta

import redis
from django.db import transaction
from django.db.models import F, Q
from django.utils import timezone

from common.storable import storable
from errors import Conflict, InvalidRequest, ServiceError

from . import conf, progress, selectors
from .models import Batch, BatchLine, File
from .tasks import run_batch as run_batch_task
from .tasks import validate_batch as validate_batch_task
from .validation import SUPPORTED_URLS, validate_jsonl

UPLOAD_PURPOSES = ("batch",)
MAX_METADATA_KEYS = 16


# ---------------------------------------------------------------- files


def upload_file(user, *, content: bytes, filename: str, purpose: str) -> File:
    if purpose not in UPLOAD_PURPOSES:
        raise InvalidRequest(
            f"purpose must be one of {', '.join(UPLOAD_PURPOSES)}; got {purpose!r}.",
            code="invalid_value",
            param="purpose",
        )
    limit = conf.get("BATCH_FILE_MAX_BYTES")
    if len(content) > limit:
        raise InvalidRequest(
            f"The file is {len(content)} bytes; the limit is {limit}.", code="file_too_large", param="file"
        )
    if not content.strip():
        raise InvalidRequest("The file is empty.", code="empty_file", param="file")
    lines = content.count(b"\n") + (0 if content.endswith(b"\n") else 1)
    if lines > conf.get("BATCH_MAX_LINES"):
        raise InvalidRequest(
            f"The file has {lines} lines; the limit is {conf.get('BATCH_MAX_LINES')}.",
            code="too_many_lines",
            param="file",
        )
    return _store_file(user, content, filename or "upload.jsonl", purpose)


def _store_file(user, content: bytes, filename: str, purpose: str) -> File:
    retention = timedelta(days=conf.get("BATCH_FILE_RETENTION_DAYS"))
    return File.objects.create(
        user=user,
        purpose=purpose,
        filename=filename[:255],
        bytes=len(content),
        content=content,
        expires_at=timezone.now() + retention,
    )


def delete_file(user, file_id: str) -> str:
    file = selectors.get_file(user, file_id)
    file.delete()
    return file_id


def delete_expired_files() -> int:
    count, _ = selectors.expired_files(timezone.now()).delete()
    return count


# ---------------------------------------------------------------- creating and validating a batch


def create_batch(user, *, input_file_id, endpoint, completion_window, metadata=None) -> Batch:
    if endpoint not in SUPPORTED_URLS:
        raise InvalidRequest(
            f"endpoint must be one of {', '.join(SUPPORTED_URLS)}.", code="invalid_value", param="endpoint"
        )
    windows = conf.get("BATCH_COMPLETION_WINDOWS")
    if completion_window not in windows:
        raise InvalidRequest(
            f"completion_window must be one of {', '.join(windows)}.", code="invalid_value", param="completion_window"
        )
    check_metadata(metadata)
    if not isinstance(input_file_id, str) or not input_file_id:
        raise InvalidRequest("input_file_id is required.", code="missing_required_parameter", param="input_file_id")
    file = selectors.get_file(user, input_file_id)
    if file.purpose != File.Purpose.BATCH:
        raise InvalidRequest(
            f"File {input_file_id} has purpose {file.purpose!r}, not 'batch'.",
            code="invalid_value",
            param="input_file_id",
        )
    now = timezone.now()
    batch = Batch.objects.create(
        user=user,
        input_file=file,
        input_file_public_id=file.public_id,
        endpoint=endpoint,
        completion_window=completion_window,
        metadata=metadata,
        expires_at=now + timedelta(seconds=windows[completion_window]),
    )
    _enqueue_or_undo(validate_batch_task, batch)
    return batch


def _enqueue_or_undo(task, batch: Batch) -> None:
    """Enqueue the batch's first task (sent at once: the row is committed); without a broker, delete
    the row and answer 503, so the caller's retry cannot leave a second batch behind."""
    from kombu.exceptions import OperationalError

    try:
        _enqueue_on_commit(task, batch.pk)
    except (OperationalError, redis.RedisError) as exc:
        Batch.objects.filter(pk=batch.pk).delete()
        raise ServiceError(
            f"A backing service (Redis) is unavailable; try again shortly. ({exc})",
            status=503,
            code="redis_unavailable",
        ) from None


def check_metadata(metadata) -> None:
    if metadata is None:
        return
    ok = (
        isinstance(metadata, dict)
        and len(metadata) <= MAX_METADATA_KEYS
        and all(
            isinstance(k, str) and len(k) <= 64 and isinstance(v, str) and len(v) <= 512 for k, v in metadata.items()
        )
    )
    if not ok:
        raise InvalidRequest(
            "metadata must be an object of at most 16 string keys (<= 64 chars) and string values (<= 512 chars).",
            code="invalid_value",
            param="metadata",
        )


def validate_batch(batch_id: int) -> None:
    """validating -> in_progress (lines stored, runner enqueued) or -> failed with every bad line listed."""
    batch = Batch.objects.select_related("user", "input_file").filter(pk=batch_id).first()
    if batch is None:
        return
    if batch.status == Batch.Status.CANCELLING and not batch.total:
        _finish_cancel_before_start(batch)
        return
    if batch.status != Batch.Status.VALIDATING:
        return  # already validated: a redelivered task does nothing
    if batch.input_file is None:
        _fail(
            batch,
            [
                {
                    "code": "file_not_found",
                    "message": "The input file was deleted.",
                    "param": "input_file_id",
                    "line": None,
                }
            ],
        )
        return
    from .lines import body_checker_for, model_problem_for  # the live endpoints' own checks

    result = validate_jsonl(
        bytes(batch.input_file.content),
        batch.endpoint,
        check_model=model_problem_for(batch.user),
        check_body=body_checker_for(batch.user),
        max_lines=conf.get("BATCH_MAX_LINES"),
    )
    if not result.ok:
        _fail(batch, result.errors)
        return
    _start(batch, result.lines)


def _fail(batch: Batch, errors: list[dict]) -> None:
    now = timezone.now()
    if Batch.objects.filter(pk=batch.pk, status=Batch.Status.VALIDATING).update(
        status=Batch.Status.FAILED, errors=errors, failed_at=now
    ):
        progress.push(batch.pk)


def _start(batch: Batch, lines) -> None:
    with transaction.atomic():
        now = timezone.now()
        moved = Batch.objects.filter(pk=batch.pk, status=Batch.Status.VALIDATING).update(
            status=Batch.Status.IN_PROGRESS, in_progress_at=now, total=len(lines)
        )
        if not moved:
            return
        BatchLine.objects.bulk_create(
            [
                BatchLine(
                    batch_id=batch.pk,
                    line_number=ln.line_number,
                    custom_id=ln.custom_id,
                    method=ln.method,
                    url=ln.url,
                    body=ln.body,
                )
                for ln in lines
            ],
            batch_size=500,
            ignore_conflicts=True,
        )
        _enqueue_on_commit(run_batch_task, batch.pk)
    progress.push(batch.pk)


def _finish_cancel_before_start(batch: Batch) -> None:
    now = timezone.now()
    if Batch.objects.filter(pk=batch.pk, status=Batch.Status.CANCELLING).update(
        status=Batch.Status.CANCELLED, cancelled_at=now
    ):
        progress.push(batch.pk)


def _enqueue_on_commit(task, batch_id: int) -> None:
    """Tasks carry ids only and are sent after the rows they read are committed."""
    transaction.on_commit(lambda: task.delay(batch_id))


# ---------------------------------------------------------------- cancel


def cancel_batch(user, batch_id: str) -> Batch:
    """in_progress/validating -> cancelling; the runner aborts in-flight lines and finalizes."""
    batch = selectors.get_batch(user, batch_id)
    if batch.status in (Batch.Status.CANCELLING, Batch.Status.CANCELLED):
        return batch
    now = timezone.now()
    moved = Batch.objects.filter(pk=batch.pk, status__in=[Batch.Status.VALIDATING, Batch.Status.IN_PROGRESS]).update(
        status=Batch.Status.CANCELLING, cancelling_at=now
    )
    if not moved:
        raise Conflict(f"Batch {batch_id} is {batch.status} and cannot be cancelled.", code="invalid_state")
    with transaction.atomic():
        # A runner that is alive notices within one loop; otherwise this task finalizes the cancel.
        task = validate_batch_task if batch.status == Batch.Status.VALIDATING else run_batch_task
        _enqueue_on_commit(task, batch.pk)
    progress.push(batch.pk)
    return selectors.get_batch(user, batch_id)


# ---------------------------------------------------------------- the runner's writes


def acquire_lease(batch_id: int, owner: str) -> bool:
    """Become the batch's only runner (the lease is free, expired, or already ours)."""
    now = timezone.now()
    until = now + timedelta(seconds=conf.get("BATCH_LEASE_SECONDS"))
    free = Batch.objects.filter(
        pk=batch_id, status__in=[Batch.Status.IN_PROGRESS, Batch.Status.CANCELLING, Batch.Status.FINALIZING]
    )
    return bool(
        free.filter(Q(lease_until__isnull=True) | Q(lease_until__lt=now) | Q(lease_owner=owner)).update(
            lease_owner=owner, lease_until=until
        )
    )


def renew_lease(batch_id: int, owner: str) -> bool:
    until = timezone.now() + timedelta(seconds=conf.get("BATCH_LEASE_SECONDS"))
    return bool(Batch.objects.filter(pk=batch_id, lease_owner=owner).update(lease_until=until))


def release_lease(batch_id: int, owner: str) -> None:
    Batch.objects.filter(pk=batch_id, lease_owner=owner).update(lease_owner="", lease_until=None)


def orphaned_lines(batch_id: int) -> list[BatchLine]:
    """Lines a dead runner left RUNNING; the new lease holder aborts and requeues them."""
    return list(BatchLine.objects.filter(batch_id=batch_id, status=BatchLine.Status.RUNNING))


def requeue_line(line: BatchLine) -> bool:
    return bool(
        BatchLine.objects.filter(
            pk=line.pk, status=BatchLine.Status.RUNNING, engine_request_id=line.engine_request_id
        ).update(status=BatchLine.Status.PENDING, reservation=None)
    )


def mark_line_running(line: BatchLine, engine_request_id: str, reservation: dict | None) -> bool:
    """pending -> running under a fresh engine request id (the only id whose result will be accepted)."""
    moved = BatchLine.objects.filter(pk=line.pk, status=BatchLine.Status.PENDING).update(
        status=BatchLine.Status.RUNNING,
        engine_request_id=engine_request_id,
        reservation=reservation,
        attempts=F("attempts") + 1,
    )
    if moved:
        line.status, line.engine_request_id, line.reservation = BatchLine.Status.RUNNING, engine_request_id, reservation
        line.attempts += 1
    return bool(moved)


def return_line_to_pending(line: BatchLine) -> None:
    """A line whose submission did not happen (quota pause, engine down) goes back to the queue."""
    BatchLine.objects.filter(
        pk=line.pk, status=BatchLine.Status.RUNNING, engine_request_id=line.engine_request_id
    ).update(status=BatchLine.Status.PENDING, reservation=None)


def record_line_result(line: BatchLine, outcome) -> bool:
    """Store one line's result exactly once; False if it was already recorded (or the line moved on).

    outcome: lines.LineOutcome (ok, status_code, body, error, usage). For a line that ran, the
    generation service calls this as its save, in the transaction that writes the usage row.
    """
    with transaction.atomic():
        moved = BatchLine.objects.filter(
            pk=line.pk, status=BatchLine.Status.RUNNING, engine_request_id=line.engine_request_id
        ).update(
            status=BatchLine.Status.COMPLETED if outcome.ok else BatchLine.Status.FAILED,
            result_id=f"batch_req_{secrets.token_hex(12)}",
            response_status=outcome.status_code,
            response_body=storable(outcome.body),  # the output file keeps U+FFFD for a NUL the model produced
            error=storable(outcome.error),
            finished_at=timezone.now(),
            reservation=None,
        )
        if not moved:
            return False
        usage = outcome.usage or {}
        counter = "completed" if outcome.ok else "failed"
        Batch.objects.filter(pk=line.batch_id).update(
            **{counter: F(counter) + 1},
            input_tokens=F("input_tokens") + usage.get("prompt_tokens", 0),
            output_tokens=F("output_tokens") + usage.get("completion_tokens", 0),
            cached_tokens=F("cached_tokens") + usage.get("cached_tokens", 0),
        )
    return True


def close_unfinished_lines(batch_id: int, status: str, code: str, message: str) -> int:
    """Lines that never ran get their final status (cancelled / expired) and an error for the error file."""
    return BatchLine.objects.filter(batch_id=batch_id, status__in=BatchLine.UNFINISHED).update(
        status=status,
        error={"code": code, "message": message},
        finished_at=timezone.now(),
        result_id="",
        reservation=None,
    )


def set_paused(batch_id: int, reason: str, retry_after_s: int) -> None:
    resume = timezone.now() + timedelta(seconds=max(1, retry_after_s))
    if (
        Batch.objects.filter(pk=batch_id)
        .exclude(paused_reason=reason)
        .update(paused_reason=reason, resume_after=resume)
    ):
        progress.push(batch_id)
    else:
        Batch.objects.filter(pk=batch_id).update(resume_after=resume)


def clear_paused(batch_id: int) -> None:
    if Batch.objects.filter(pk=batch_id).exclude(paused_reason="").update(paused_reason="", resume_after=None):
        progress.push(batch_id)


def begin_cancel_or_expiry(batch_id: int) -> str | None:
    """Which ending the runner must carry out now: 'cancelled', 'expired', or None to keep going."""
    batch = Batch.objects.filter(pk=batch_id).only("status", "expires_at").first()
    if batch is None:
        return "cancelled"
    if batch.status == Batch.Status.CANCELLING:
        return "cancelled"
    if batch.status == Batch.Status.IN_PROGRESS and batch.expires_at <= timezone.now():
        return "expired"
    return None


# ---------------------------------------------------------------- finalizing

FINAL_TIMESTAMPS = {
    Batch.Status.COMPLETED: "completed_at",
    Batch.Status.CANCELLED: "cancelled_at",
    Batch.Status.EXPIRED: "expired_at",
}


def finalize_batch(batch_id: int, final_status: str) -> None:
    """-> finalizing -> completed | expired, or cancelling -> cancelled, writing the output and error
    files atomically. A cancelled batch reads "cancelling" until it is "cancelled" (as OpenAI's do):
    "finalizing" would tell a client that polls it that the batch is completing."""
    batch = Batch.objects.select_related("user").get(pk=batch_id)
    if batch.is_terminal:
        return
    writing = Batch.Status.CANCELLING if final_status == Batch.Status.CANCELLED else Batch.Status.FINALIZING
    if batch.status != writing:  # a cancel is cancelling already
        Batch.objects.filter(pk=batch_id, status=batch.status).update(status=writing, finalizing_at=timezone.now())
        progress.push(batch_id)
    # Read first, then write in one short transaction (SQLite: a reader that turns writer can be refused).
    output = _jsonl(output_line(line) for line in selectors.finished_lines(batch_id, [BatchLine.Status.COMPLETED]))
    errors = _jsonl(
        error_line(line)
        for line in selectors.finished_lines(
            batch_id, [BatchLine.Status.FAILED, BatchLine.Status.CANCELLED, BatchLine.Status.EXPIRED]
        )
    )
    base = batch.public_id
    with transaction.atomic():
        output_file = _result_file(batch.user, output, f"{base}_output.jsonl")
        error_file = _result_file(batch.user, errors, f"{base}_error.jsonl")
        finished = Batch.objects.filter(pk=batch_id, status=writing).update(
            status=final_status,
            output_file=output_file,
            error_file=error_file,
            paused_reason="",
            lease_owner="",
            lease_until=None,
            **{FINAL_TIMESTAMPS[final_status]: timezone.now()},
        )
        if not finished:  # someone else finalized it meanwhile: keep theirs, drop these files
            transaction.set_rollback(True)
    progress.push(batch_id)


def _result_file(user, content: bytes, filename: str) -> File | None:
    return _store_file(user, content, filename, File.Purpose.BATCH_OUTPUT) if content else None


def _jsonl(rows) -> bytes:
    return "".join(json.dumps(row, separators=(",", ":"), ensure_ascii=False) + "\n" for row in rows).encode()


def output_line(line: BatchLine) -> dict:
    return {
        "id": line.result_id,
        "custom_id": line.custom_id,
        "response": {
            "status_code": line.response_status,
            "request_id": line.engine_request_id,
            "body": line.response_body,
        },
        "error": None,
    }


def error_line(line: BatchLine) -> dict:
    response = None
    if line.response_status is not None:
        response = {
            "status_code": line.response_status,
            "request_id": line.engine_request_id,
            "body": line.response_body,
        }
    return {
        "id": line.result_id or f"batch_req_{secrets.token_hex(12)}",
        "custom_id": line.custom_id,
        "response": response,
        "error": line.error,
    }


# ---------------------------------------------------------------- periodic work


def batches_needing_a_runner() -> list[int]:
    """Unfinished batches with no live runner (crashed worker, lost task, pause over) and stuck validations."""
    now = timezone.now()
    return selectors.stalled_batches(now) + selectors.stuck_validations(
        now - timedelta(seconds=max(60, conf.get("BATCH_LEASE_SECONDS") * 3)), now
    )


def expire_overdue_batches() -> list[int]:
    """Past the completion window. A batch still validating expires at once; a running one is left to
    its runner (or to the runner the watchdog starts), which aborts, closes the rest as batch_expired
    and finalizes with the partial output. Returns the ids expired here."""
    now = timezone.now()
    expired = []
    for batch_id in selectors.overdue_batches(now):
        if Batch.objects.filter(pk=batch_id, status=Batch.Status.VALIDATING).update(
            status=Batch.Status.EXPIRED, expired_at=now
        ):
            expired.append(batch_id)
            progress.push(batch_id)
    return expired


def mark_kicked(batch_ids: list[int]) -> list[int]:
    """Debounce the watchdog: a batch just handed to a runner is not handed again for two leases."""
    if batch_ids:
        later = timezone.now() + timedelta(seconds=2 * conf.get("BATCH_LEASE_SECONDS"))
        Batch.objects.filter(pk__in=batch_ids).update(resume_after=later)
    return batch_ids


def is_validating(batch_id: int) -> bool:
    return Batch.objects.filter(pk=batch_id, status=Batch.Status.VALIDATING).exists()
