"""The batch runner: feeds a batch's pending lines to the engine with a bounded number in flight.

One runner per batch at a time (a lease row in the batch, renewed by a thread while it runs). The
runner polls its lines' output streams coarsely (batches.collector) instead of following them token
by token, and finishes each line's generation through the generation service, which records
its result exactly once by a conditional update (services.record_line_result) with its usage row.

After a crash the next lease holder re-attaches to the lines the dead runner left running (their
engine output streams are still in Redis), so a line that was already generated is not generated
again; a line whose stream is gone is aborted (so a queued copy never runs) and requeued.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import uuid

from django import db

from engine_client import client as engine
from errors import QuotaExceeded, ServiceError
from generation import catalog
from generation import services as generation
from openai_api.calls import ApiCall
from quotas import services as quotas
from quotas.ledger import Reservation
from quotas.selectors import plan_for

from . import conf, lines, progress, selectors, services
from .collector import Collector
from .models import Batch, BatchLine

log = logging.getLogger(__name__)

# Codes of errors.EngineFailure a line is run again after (engine_unavailable: no worker serves its model).
RETRYABLE_CODES = ("worker_lost", "worker_shutdown", "engine_unavailable", "engine_error", "expired")
MAX_ATTEMPTS = 3
NO_WORKER_PAUSE_S = 10


class LeaseLost(Exception):
    """Another runner owns the batch now: stop without touching it."""


class LeaseKeeper(threading.Thread):
    """Renews the runner's lease from its own thread, so slow work in the main loop (loading the
    tokenizer, a burst of submissions) never lets it lapse while the runner is alive."""

    def __init__(self, batch_id: int, owner: str):
        super().__init__(name=f"batch{batch_id}-lease", daemon=True)
        self.batch_id, self.owner = batch_id, owner
        self.lost = threading.Event()
        self.done = threading.Event()

    def run(self) -> None:
        try:
            while not self.done.wait(conf.get("BATCH_LEASE_SECONDS") / 4):
                if not services.renew_lease(self.batch_id, self.owner):
                    self.lost.set()
                    return
        finally:
            db.connection.close()  # this thread's own connection

    def stop(self) -> None:
        self.done.set()
        self.join(5)


class BatchRunner:
    def __init__(self, batch_id: int):
        self.batch_id = batch_id
        self.owner = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self.batch = Batch.objects.select_related("user").get(pk=batch_id)
        self.user = self.batch.user
        self.plan = plan_for(self.user)
        self.models = catalog.known_models()
        self.in_flight: dict[str, tuple[BatchLine, ApiCall]] = {}  # engine request id -> (line, call)
        self.collector = Collector(timeout=conf.get("BATCH_LINE_TIMEOUT"))
        self.max_in_flight = conf.get("BATCH_MAX_IN_FLIGHT")
        self.paused = False
        self.stopping = False
        self.last_renew = self.last_push = time.monotonic()
        self.dirty = False

    # ------------------------------------------------------------ top level

    def run(self) -> str:
        """Run the batch to its end; returns the final status, or 'busy'/'paused'/'lost'."""
        if not services.acquire_lease(self.batch_id, self.owner):
            return "busy"
        self.lease = LeaseKeeper(self.batch_id, self.owner)
        self.lease.start()
        try:
            if self.batch.status == Batch.Status.FINALIZING:
                ending = self.ending_after_crash()
            else:
                self.reattach_orphans()
                ending = self.loop()
            if ending in (Batch.Status.COMPLETED, Batch.Status.CANCELLED, Batch.Status.EXPIRED):
                services.finalize_batch(self.batch_id, ending)
            return ending
        except LeaseLost:
            self.abandon_in_flight()
            return "lost"
        finally:
            self.lease.stop()
            services.release_lease(self.batch_id, self.owner)

    def loop(self) -> str:
        while True:
            self.keep_lease()
            ending = services.begin_cancel_or_expiry(self.batch_id)
            if ending:
                return self.stop(ending)
            if not self.paused:
                self.fill()
            elif not self.in_flight:
                return "paused"  # the watchdog resumes it after resume_after; no worker slot is held meanwhile
            if not self.in_flight:
                if not selectors.has_unfinished_lines(self.batch_id):
                    return Batch.Status.COMPLETED
                time.sleep(0.2)  # nothing could be fed right now (e.g. a line mid-requeue): poll gently
                continue
            self.collect()
            self.maybe_push()

    # ------------------------------------------------------------ feeding

    def fill(self) -> None:
        room = self.max_in_flight - len(self.in_flight)
        if room <= 0:
            return
        for line in selectors.pending_lines(self.batch_id, room):
            if not self.start_line(line):
                break

    def start_line(self, line: BatchLine) -> bool:
        """Admit, mark running, submit; the collector watches it. False stops this round of feeding."""
        try:
            call = lines.build_call(line.url, line.body, user=self.user, models=self.models)
            generation.admit(call.gen, plan=self.plan)  # the token budgets only: see quotas.reserve
        except QuotaExceeded as spent:
            self.pause(budget_spent_reason(spent), spent.retry_after)
            return False
        except ServiceError as error:  # the endpoint's or the plan's refusal: the line fails, the batch goes on
            self.fail_before_submit(line, lines.refused_outcome(error))
            return True
        services.clear_paused(self.batch_id)
        if not services.mark_line_running(line, call.request_id, call.gen.reservation.as_dict()):
            generation.release(call.gen)
            return True
        try:
            generation.submit(call.gen)
        except Exception:
            log.exception("batch %s: submitting line %s failed", self.batch_id, line.line_number)
            services.return_line_to_pending(line)
            generation.release(call.gen)
            self.pause("Waiting: the engine request queue is unreachable.", NO_WORKER_PAUSE_S)
            return False
        self.watch(line, call)
        return True

    def watch(self, line: BatchLine, call: ApiCall) -> None:
        self.collector.add(call.request_id, call.model)
        self.in_flight[call.request_id] = (line, call)

    def fail_before_submit(self, line: BatchLine, outcome) -> None:
        """A line the endpoint or the plan refuses: recorded as failed without reaching the engine."""
        if services.mark_line_running(line, f"unsent-{uuid.uuid4().hex}", None):
            services.record_line_result(line, outcome)
            self.dirty = True

    def pause(self, reason: str, retry_after_s: int) -> None:
        self.paused = True
        services.set_paused(self.batch_id, reason, retry_after_s)

    # ------------------------------------------------------------ results

    def collect(self) -> None:
        time.sleep(conf.get("BATCH_POLL_INTERVAL"))
        for request_id, events in self.collector.poll():
            line, call = self.in_flight.pop(request_id)
            generation.fold_output(call.gen, events)
            self.finish_line(line, call)

    def finish_line(self, line: BatchLine, call: ApiCall) -> None:
        outcome = lines.outcome(call)
        code = outcome.error_code
        if code in RETRYABLE_CODES and line.attempts < MAX_ATTEMPTS:
            generation.settle_quota(call.gen)  # this attempt's tokens; the next one reserves again
            services.requeue_line(line)
            if code == "engine_unavailable":
                self.pause("Waiting: no engine worker is running.", NO_WORKER_PAUSE_S)
            return
        if call.gen.result.was_aborted:
            generation.settle_quota(call.gen)
            if not self.stopping:  # aborted by someone else: run it again
                services.requeue_line(line)
            return  # aborted by our cancel/expiry: closed with the other unfinished lines
        if generation.finish(call.gen, save=lambda _gen: services.record_line_result(line, outcome)):
            self.dirty = True
        engine.client().delete_output(line.engine_request_id)

    # ------------------------------------------------------------ endings

    def stop(self, ending: str) -> str:
        """Cancel or expiry: abort what runs, keep what already finished, close the rest."""
        self.stopping = True
        for line, _call in self.in_flight.values():
            engine.client().abort(line.engine_request_id)
        while self.in_flight:
            self.keep_lease()
            self.collect()
        status = BatchLine.Status.CANCELLED if ending == Batch.Status.CANCELLED else BatchLine.Status.EXPIRED
        code = "batch_cancelled" if ending == Batch.Status.CANCELLED else "batch_expired"
        message = (
            "The batch was cancelled before this request ran."
            if ending == Batch.Status.CANCELLED
            else "This request could not be executed before the completion window expired."
        )
        for line in services.orphaned_lines(self.batch_id):
            release_reservation(line)
        services.close_unfinished_lines(self.batch_id, status, code, message)
        return ending

    def ending_after_crash(self) -> str:
        batch = Batch.objects.get(pk=self.batch_id)
        if batch.cancelling_at:
            return Batch.Status.CANCELLED
        if batch.lines.filter(status=BatchLine.Status.EXPIRED).exists():
            return Batch.Status.EXPIRED
        return Batch.Status.COMPLETED

    def reattach_orphans(self) -> None:
        """Lines a dead runner left running: follow their engine output if it exists, else requeue."""
        for line in services.orphaned_lines(self.batch_id):
            if engine.client().has_output(line.engine_request_id):
                call = lines.build_call(line.url, line.body, user=self.user, models=self.models)
                call.gen.request_id = line.engine_request_id
                call.gen.reservation = Reservation.from_dict(line.reservation) if line.reservation else None
                self.watch(line, call)
            else:
                engine.client().abort(line.engine_request_id)  # a copy still queued must never run
                release_reservation(line)
                services.requeue_line(line)

    def abandon_in_flight(self) -> None:
        self.in_flight.clear()  # the new lease holder re-attaches to them
        self.collector.watched.clear()

    # ------------------------------------------------------------ housekeeping

    def keep_lease(self) -> None:
        if self.lease.lost.is_set():
            raise LeaseLost(self.batch_id)
        now = time.monotonic()
        if now - self.last_renew >= conf.get("BATCH_LEASE_SECONDS"):
            self.last_renew = now
            self.models = catalog.known_models()  # workers come and go

    def maybe_push(self) -> None:
        now = time.monotonic()
        if self.dirty and now - self.last_push >= conf.get("BATCH_PROGRESS_INTERVAL"):
            progress.push(self.batch_id)
            self.dirty, self.last_push = False, now


def budget_spent_reason(spent: QuotaExceeded) -> str:
    which = "daily" if spent.limit == "tokens_per_day" else "monthly"
    return (
        f"Paused: the {which} token budget is spent; the batch resumes when it resets (in about {spent.retry_after}s)."
    )


def release_reservation(line: BatchLine) -> None:
    """A line's reservation nothing will run for any more (its stream is gone, the batch stopped)."""
    if line.reservation:
        quotas.settle(Reservation.from_dict(line.reservation), 0, 0)


def run_batch(batch_id: int) -> str:
    if not Batch.objects.filter(pk=batch_id).exists():
        return "missing"
    return BatchRunner(batch_id).run()
