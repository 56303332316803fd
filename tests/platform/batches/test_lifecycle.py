"""Batch lifecycle in the services: transitions, exactly-once results, finalize, expiry, pause on quota."""

from __future__ import annotations

import json
from datetime import timedelta

import pytest
from batch_testing import chat_line, jsonl
from django.utils import timezone

from batches import presenters, selectors, services
from batches.lines import LineOutcome
from batches.models import Batch, BatchLine
from batches.runner import BatchRunner
from errors import Conflict
from generation import services as generation
from generation.services import Generation
from quotas.selectors import get_ledger
from usage.models import UsageRecord

pytestmark = pytest.mark.django_db


def started_batch(user, n: int = 3) -> Batch:
    file = services.upload_file(
        user, content=jsonl([chat_line(f"r{i}") for i in range(n)]), filename="in.jsonl", purpose="batch"
    )
    batch = services.create_batch(
        user, input_file_id=file.public_id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    services.validate_batch(batch.pk)
    batch.refresh_from_db()
    assert batch.status == Batch.Status.IN_PROGRESS
    return batch


def ok_outcome(text: str) -> LineOutcome:
    body = {
        "id": "chatcmpl-x",
        "object": "chat.completion",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "length"}],
    }
    return LineOutcome(
        ok=True, status_code=200, body=body, usage={"prompt_tokens": 5, "completion_tokens": 2, "cached_tokens": 1}
    )


def test_a_line_result_is_recorded_exactly_once(user):
    batch = started_batch(user)
    line = batch.lines.get(custom_id="r0")
    assert services.mark_line_running(line, "req-1", None)
    assert not services.mark_line_running(line, "req-2", None)  # already running
    gen = Generation(
        source="batch",
        endpoint=line.url,
        user=user,
        model="tiny",
        prompts=[[1] * 5],
        sampling_params={},
        request_id="req-1",
    )
    assert generation.finish(gen, save=lambda _gen: services.record_line_result(line, ok_outcome("hi")))
    again = Generation(
        source="batch",
        endpoint=line.url,
        user=user,
        model="tiny",
        prompts=[[1] * 5],
        sampling_params={},
        request_id="req-1",
    )
    assert not generation.finish(again, save=lambda _gen: services.record_line_result(line, ok_outcome("again")))
    assert list(UsageRecord.objects.values_list("source", "request_id")) == [("batch", "req-1")]  # once
    batch.refresh_from_db()
    assert (batch.completed, batch.failed, batch.input_tokens, batch.output_tokens, batch.cached_tokens) == (
        1,
        0,
        5,
        2,
        1,
    )


def test_a_stale_runner_cannot_record_a_line_another_runner_resubmitted(user):
    batch = started_batch(user)
    old = batch.lines.get(custom_id="r1")
    services.mark_line_running(old, "dead-runner-request", None)
    assert services.requeue_line(old)  # the new lease holder takes it back
    new = batch.lines.get(custom_id="r1")
    services.mark_line_running(new, "new-runner-request", None)
    assert not services.record_line_result(old, ok_outcome("stale"))
    assert services.record_line_result(new, ok_outcome("fresh"))
    assert BatchLine.objects.get(pk=new.pk).response_body["choices"][0]["message"]["content"] == "fresh"
    assert BatchLine.objects.get(pk=new.pk).attempts == 2


def test_finalize_writes_output_and_error_files_with_every_line_once(user):
    batch = started_batch(user, n=4)
    lines = list(batch.lines.order_by("line_number"))
    for line, outcome in zip(lines[:2], [ok_outcome("a"), ok_outcome("b")]):
        services.mark_line_running(line, f"req-{line.custom_id}", None)
        services.record_line_result(line, outcome)
    failing = lines[2]
    services.mark_line_running(failing, "req-fail", None)
    services.record_line_result(
        failing,
        LineOutcome(
            ok=False,
            status_code=400,
            body={
                "error": {
                    "message": "bad",
                    "type": "invalid_request_error",
                    "param": "max_tokens",
                    "code": "invalid_value",
                }
            },
        ),
    )
    services.close_unfinished_lines(batch.pk, BatchLine.Status.EXPIRED, "batch_expired", "too late")
    services.finalize_batch(batch.pk, Batch.Status.EXPIRED)
    batch.refresh_from_db()
    assert batch.status == Batch.Status.EXPIRED and batch.finalizing_at and batch.expired_at
    output = [json.loads(x) for x in bytes(batch.output_file.content).decode().splitlines()]
    errors = [json.loads(x) for x in bytes(batch.error_file.content).decode().splitlines()]
    assert [r["custom_id"] for r in output] == ["r0", "r1"]
    assert output[0]["response"] == {"status_code": 200, "request_id": "req-r0", "body": ok_outcome("a").body}
    assert output[0]["error"] is None and output[0]["id"].startswith("batch_req_")
    assert [(r["custom_id"], r["response"] and r["response"]["status_code"]) for r in errors] == [
        ("r2", 400),
        ("r3", None),
    ]
    assert errors[1]["error"] == {"code": "batch_expired", "message": "too late"}
    assert batch.output_file.purpose == "batch_output" and batch.output_file.user == user
    services.finalize_batch(batch.pk, Batch.Status.COMPLETED)  # idempotent: a terminal batch stays as it is
    assert Batch.objects.get(pk=batch.pk).status == Batch.Status.EXPIRED


def test_cancel_transitions_and_refusals(user, monkeypatch):
    batch = started_batch(user)
    cancelled = services.cancel_batch(user, batch.public_id)
    assert cancelled.status == Batch.Status.CANCELLING and cancelled.cancelling_at
    assert services.begin_cancel_or_expiry(batch.pk) == "cancelled"
    services.close_unfinished_lines(batch.pk, BatchLine.Status.CANCELLED, "batch_cancelled", "cancelled")
    shown = []  # what each progress push (and so every poller) saw
    monkeypatch.setattr(services.progress, "push", lambda pk: shown.append(Batch.objects.get(pk=pk).status))
    services.finalize_batch(batch.pk, Batch.Status.CANCELLED)
    final = Batch.objects.get(pk=batch.pk)
    assert final.status == Batch.Status.CANCELLED and final.finalizing_at is None
    assert shown == [Batch.Status.CANCELLED]  # cancelling until cancelled, never "finalizing" (as OpenAI's)
    done = started_batch(user)
    Batch.objects.filter(pk=done.pk).update(status=Batch.Status.COMPLETED)
    with pytest.raises(Conflict):
        services.cancel_batch(user, done.public_id)


def test_cancelling_before_validation_ends_cancelled_without_running(user):
    file = services.upload_file(user, content=jsonl([chat_line("a")]), filename="in.jsonl", purpose="batch")
    batch = services.create_batch(
        user, input_file_id=file.public_id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    services.cancel_batch(user, batch.public_id)
    services.validate_batch(batch.pk)  # the queued validation task finds it cancelling
    batch.refresh_from_db()
    assert batch.status == Batch.Status.CANCELLED and not batch.lines.exists()


def test_expiry_of_a_batch_stuck_in_validation_and_the_watchdogs_view(user):
    file = services.upload_file(user, content=jsonl([chat_line("a")]), filename="in.jsonl", purpose="batch")
    stuck = services.create_batch(
        user, input_file_id=file.public_id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    running = started_batch(user)
    past = timezone.now() - timedelta(seconds=1)
    Batch.objects.filter(pk__in=[stuck.pk, running.pk]).update(expires_at=past)
    assert services.expire_overdue_batches() == [stuck.pk]
    stuck.refresh_from_db()
    assert stuck.status == Batch.Status.EXPIRED and stuck.expired_at
    # the running one has no live runner, so the watchdog hands it to one, which expires it
    assert running.pk in services.batches_needing_a_runner()
    assert services.begin_cancel_or_expiry(running.pk) == "expired"
    services.mark_kicked([running.pk])
    assert running.pk in services.batches_needing_a_runner()  # overdue batches are never left resting


def test_a_live_lease_keeps_the_watchdog_away_and_an_expired_one_does_not(user):
    batch = started_batch(user)
    assert services.acquire_lease(batch.pk, "runner-a")
    assert not services.acquire_lease(batch.pk, "runner-b")
    assert batch.pk not in services.batches_needing_a_runner()
    Batch.objects.filter(pk=batch.pk).update(lease_until=timezone.now() - timedelta(seconds=1))
    assert batch.pk in services.batches_needing_a_runner()
    assert services.acquire_lease(batch.pk, "runner-b")  # a dead runner's lease is taken over
    assert not services.renew_lease(batch.pk, "runner-a")


def test_a_spent_daily_budget_pauses_the_batch_instead_of_failing_it(user, settings):
    settings.QUOTA_DEFAULT_PLAN = {**settings.QUOTA_DEFAULT_PLAN, "tokens_per_day": 5}
    keys = get_ledger().user_keys(user.pk, source="batch")
    get_ledger().redis.delete(keys["day"], keys["month"])
    batch = started_batch(user)
    assert BatchRunner(batch.pk).run() == "paused"
    batch.refresh_from_db()
    assert batch.status == Batch.Status.IN_PROGRESS and batch.failed == 0
    assert "daily token budget" in batch.paused_reason
    assert presenters.batch_object(batch)["paused_reason"] == batch.paused_reason
    assert batch.lines.filter(status=BatchLine.Status.PENDING).count() == 3
    assert batch.lease_owner == ""  # no worker is held while paused
    now = timezone.now()
    assert batch.pk not in selectors.stalled_batches(now)  # resting until the budget resets
    assert batch.pk in selectors.stalled_batches(batch.resume_after + timedelta(seconds=1))


def test_expired_files_are_deleted(user):
    file = services.upload_file(user, content=jsonl([chat_line("a")]), filename="in.jsonl", purpose="batch")
    keep = services.upload_file(user, content=jsonl([chat_line("b")]), filename="in.jsonl", purpose="batch")
    type(file).objects.filter(pk=file.pk).update(expires_at=timezone.now() - timedelta(seconds=1))
    assert services.delete_expired_files() == 1
    assert list(type(file).objects.values_list("pk", flat=True)) == [keep.pk]


def test_a_nul_the_model_produced_is_kept_as_u_fffd_in_the_output_file(user):
    # PostgreSQL's jsonb cannot hold \u0000 (make test runs on it): without common.storable the line's result
    # was never recorded and its batch stalled with the line running.
    batch = started_batch(user, n=1)
    [line] = batch.lines.all()
    services.mark_line_running(line, "req-nul", None)
    assert services.record_line_result(line, ok_outcome("a\x00b"))
    services.finalize_batch(batch.pk, Batch.Status.COMPLETED)
    batch.refresh_from_db()
    [row] = [json.loads(x) for x in bytes(batch.output_file.content).decode().splitlines()]
    assert row["response"]["body"]["choices"][0]["message"]["content"] == "a\ufffdb"
