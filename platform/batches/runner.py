"""The batch runner: feeds a batch's pending lines to the engine with a bounded number in flight.

One runner per batch at a time (a lease row in the batch, renewed by a thread while it runs). The
runner polls its lines' output streams coarsely (batches.collector) instead of following them token
by token, and records each line's result exactly once by a conditional update
(services.record_line_result).

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
from errors import ServiceError

from . import conf, engine_calls, progress, quota, selectors, services
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
        self.plan = quota.token_budget_plan(self.user)
        self.models = engine_calls.served_models()
        self.in_flight: dict[str, tuple[BatchLine, object]] = {}  # engine request id -> (line, Generation)
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
        """Reserve, mark running, submit, and wait for it in a thread; False stops this round of feeding."""
        try:
            gen = engine_calls.build_call(line.url, line.body, self.models)
            reservation = quota.reserve_line(self.user, self.plan, gen.model, gen.prompt_tokens,
                                             engine_calls.reserved_completion_tokens(gen))
        except quota.BudgetSpent as spent:
            self.pause(spent.reason, spent.retry_after_s)
            return False
        except ServiceError as error:  # the endpoint's or the plan's refusal: the line fails, the batch goes on
            self.fail_before_submit(line, engine_calls.refused_outcome(error))
            return True
        services.clear_paused(self.batch_id)
        if not services.mark_line_running(line, gen.request_id, reservation.as_dict()):
            quota.settle_line(reservation.as_dict(), 0, 0)
            return True
        try:
            engine_calls.submit(gen, self.user.pk)
        except Exception:
            log.exception("batch %s: submitting line %s failed", self.batch_id, line.line_number)
            services.return_line_to_pending(line)
            quota.settle_line(line.reservation, 0, 0)
            self.pause("Waiting: the engine request queue is unreachable.", NO_WORKER_PAUSE_S)
            return False
        self.watch(line, gen)
        return True

    def watch(self, line: BatchLine, gen) -> None:
        self.collector.add(gen.request_id, gen.n, gen.model)
        self.in_flight[gen.request_id] = (line, gen)

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
        for request_id, result, latency_ms in self.collector.poll():
            line, gen = self.in_flight.pop(request_id)
            self.finish_line(line, gen, engine_calls.outcome(gen, result, latency_ms))

    def finish_line(self, line: BatchLine, gen, outcome) -> None:
        usage = outcome.usage or {}
        quota.settle_line(line.reservation, usage.get("prompt_tokens", 0), usage.get("completion_tokens", 0))
        code = outcome.error_code
        if code in RETRYABLE_CODES and line.attempts < MAX_ATTEMPTS:
            services.requeue_line(line)
            if code == "engine_unavailable":
                self.pause("Waiting: no engine worker is running.", NO_WORKER_PAUSE_S)
            return
        if engine_calls.was_aborted(outcome):
            if not self.stopping:  # aborted by someone else: run it again
                services.requeue_line(line)
            return  # aborted by our cancel/expiry: closed with the other unfinished lines
        if services.record_line_result(line, outcome, self.usage_row(line, gen, outcome)):
            self.dirty = True
        engine.client().delete_output(line.engine_request_id)

    def usage_row(self, line: BatchLine, gen, outcome) -> dict:
        usage, metrics = outcome.usage or {}, outcome.metrics or {}
        return dict(user=self.user, source="batch", endpoint=line.url, model=gen.model,
                    request_id=line.engine_request_id, prompt_tokens=usage.get("prompt_tokens", 0),
                    completion_tokens=usage.get("completion_tokens", 0), cached_tokens=usage.get("cached_tokens", 0),
                    ttft_ms=submitted_ttft_ms(metrics), engine_ttft_ms=metrics.get("ttft_ms"),
                    latency_ms=outcome.latency_ms, status_code=outcome.status_code, error_code=outcome.error_code or "")

    # ------------------------------------------------------------ endings

    def stop(self, ending: str) -> str:
        """Cancel or expiry: abort what runs, keep what already finished, close the rest."""
        self.stopping = True
        for line, _gen in self.in_flight.values():
            engine.client().abort(line.engine_request_id)
        while self.in_flight:
            self.keep_lease()
            self.collect()
        status = BatchLine.Status.CANCELLED if ending == Batch.Status.CANCELLED else BatchLine.Status.EXPIRED
        code = "batch_cancelled" if ending == Batch.Status.CANCELLED else "batch_expired"
        message = ("The batch was cancelled before this request ran." if ending == Batch.Status.CANCELLED
                   else "This request could not be executed before the completion window expired.")
        for line in services.orphaned_lines(self.batch_id):
            quota.settle_line(line.reservation, 0, 0)
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
                gen = engine_calls.build_call(line.url, line.body, self.models)
                gen.request_id = line.engine_request_id
                self.watch(line, gen)
            else:
                engine.client().abort(line.engine_request_id)  # a copy still queued must never run
                quota.settle_line(line.reservation, 0, 0)
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
            self.models = engine_calls.served_models()  # workers come and go

    def maybe_push(self) -> None:
        now = time.monotonic()
        if self.dirty and now - self.last_push >= conf.get("BATCH_PROGRESS_INTERVAL"):
            progress.push(self.batch_id)
            self.dirty, self.last_push = False, now


def submitted_ttft_ms(metrics: dict) -> float | None:
    """A line's TTFT from its submission (its "arrival"): the wait in the queue plus the engine's TTFT.

    The runner polls coarsely, so it cannot see the first token arrive; the worker's own times can."""
    if metrics.get("queue_ms") is None or metrics.get("ttft_ms") is None:
        return None
    return metrics["queue_ms"] + metrics["ttft_ms"]


def run_batch(batch_id: int) -> str:
    if not Batch.objects.filter(pk=batch_id).exists():
        return "missing"
    return BatchRunner(batch_id).run()

