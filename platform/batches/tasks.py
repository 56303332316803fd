"""Celery tasks: ids only, idempotent, thin (the work is in services and the runner).

Task bodies import what they call (HackSoft's rule): services enqueue these tasks, so a
module-level import of services here would be a cycle.

acks_late + reject_on_worker_lost: a task whose worker dies is delivered again, and running it
again is harmless (status checks, the runner lease, per-line conditional updates). The periodic
watchdog also restarts batches whose runner vanished, without waiting for the broker's
visibility timeout.
"""

from __future__ import annotations

import logging

from celery import shared_task
from celery.exceptions import SoftTimeLimitExceeded

log = logging.getLogger(__name__)

TASK_OPTIONS = {"acks_late": True, "reject_on_worker_lost": True, "ignore_result": True}


@shared_task(name="batches.validate_batch", **TASK_OPTIONS)
def validate_batch(batch_id: int) -> None:
    from .services import validate_batch as validate

    validate(batch_id)


@shared_task(name="batches.run_batch", **TASK_OPTIONS)
def run_batch(batch_id: int) -> str:
    from .runner import run_batch as run

    try:
        return run(batch_id)
    except SoftTimeLimitExceeded:
        # Long batches continue in a fresh task; the next runner re-attaches to the lines in flight.
        run_batch.apply_async((batch_id,), countdown=1)
        return "continued"


@shared_task(name="batches.watchdog", **TASK_OPTIONS)
def watchdog() -> dict:
    """Expire overdue batches and restart batches that have no live runner (crash, lost task, pause over)."""
    from . import services

    expired = services.expire_overdue_batches()
    stalled = services.mark_kicked(services.batches_needing_a_runner())
    for batch_id in stalled:
        (validate_batch if services.is_validating(batch_id) else run_batch).delay(batch_id)
    return {"expired": expired, "restarted": stalled}


@shared_task(name="batches.delete_expired_files", **TASK_OPTIONS)
def delete_expired_files() -> int:
    from .services import delete_expired_files as delete

    return delete()
