"""generate_usage, the periodic roll-up task and its beat entry, and the batch panel's selector."""

from datetime import timedelta

import pytest
from django.conf import settings
from django.core.management import call_command
from django.utils import timezone

from dashboard import selectors
from dashboard.models import RollupState, UsageHourly
from usage.models import UsageRecord

pytestmark = pytest.mark.django_db


def test_generate_usage_makes_realistic_rows_and_rolls_them_up():
    call_command(
        "generate_usage", days=2, users=4, requests_per_day=300, seed=1, batches=5, stdout=open("/dev/null", "w")
    )
    rows = UsageRecord.objects.all()
    assert rows.count() > 150  # 2 days of 300, weekends at 40%: about 240 when both days are a weekend's
    assert set(rows.values_list("source", flat=True)) == {"api", "playground", "batch"}
    assert rows.values("model").distinct().count() >= 2
    assert rows.filter(source="api", api_key__isnull=False).exists()
    assert not rows.filter(source="playground", api_key__isnull=False).exists()
    assert rows.filter(status_code=429).exists()
    served = rows.filter(status_code=200)
    assert not served.filter(ttft_ms__isnull=True).exists()
    assert all(r.latency_ms >= r.ttft_ms for r in served[:200])
    oldest = rows.order_by("created_at").first().created_at
    assert timezone.now() - oldest > timedelta(days=1, hours=20)
    batches = selectors.batch_summary()
    assert sum(batches["by_status"].values()) == 5 and batches["oldest_running"] is not None
    assert batches["lines_per_s"] > 0
    assert (
        sum(UsageHourly.objects.values_list("requests", flat=True))
        == rows.filter(created_at__lt=RollupState.objects.get().rolled_until).count()
    )


def test_roll_up_task_is_registered_and_scheduled():
    from dashboard import tasks
    from tessera.celery import app

    entry = settings.CELERY_BEAT_SCHEDULE["dashboard-roll-up-usage"]
    assert entry["task"] == tasks.roll_up_usage.name and entry["task"] in app.tasks
    UsageRecord.objects.create(
        user=_user(), source="api", model="m", prompt_tokens=3, completion_tokens=4, ttft_ms=5.0, latency_ms=20.0
    )
    UsageRecord.objects.update(created_at=timezone.now() - timedelta(hours=2))
    result = tasks.roll_up_usage.apply().get()  # the task body, in process
    assert result["rows"] == 1
    tasks.roll_up_usage.apply().get()
    assert UsageHourly.objects.get().requests == 1  # idempotent


def _user():
    from django.contrib.auth import get_user_model

    return get_user_model().objects.create_user("task-user")


def test_batch_summary_counts_statuses_and_finds_the_oldest_running():
    from batches.models import Batch, BatchLine

    user = _user()
    now = timezone.now()

    def batch(status, started_minutes_ago=None, **extra):
        return Batch.objects.create(
            user=user,
            input_file_public_id="file-x",
            endpoint="/v1/chat/completions",
            status=status,
            expires_at=now + timedelta(hours=24),
            in_progress_at=None if started_minutes_ago is None else now - timedelta(minutes=started_minutes_ago),
            **extra,
        )

    old = batch(Batch.Status.IN_PROGRESS, 30, total=10, completed=4)
    batch(Batch.Status.IN_PROGRESS, 5)
    batch(Batch.Status.COMPLETED)
    batch(Batch.Status.COMPLETED)
    batch(Batch.Status.FAILED)
    for i in range(6):
        BatchLine.objects.create(
            batch=old,
            line_number=i,
            custom_id=f"c{i}",
            url="/v1/chat/completions",
            body={},
            status="completed",
            finished_at=now - timedelta(seconds=10 if i < 3 else 600),
        )
    got = selectors.batch_summary(now=now)
    assert got["by_status"]["in_progress"] == 2 and got["by_status"]["completed"] == 2
    assert got["by_status"]["failed"] == 1 and got["by_status"]["cancelled"] == 0
    assert got["lines_per_s"] == round(3 / 60, 3)
    assert got["oldest_running"]["id"] == old.public_id
    assert got["oldest_running"]["age_s"] == 30 * 60
    assert got["oldest_running"]["completed"] == 4


# /metrics renders in a worker thread with its own connection: the rows must be committed.
@pytest.mark.django_db(transaction=True)
def test_metrics_endpoint_carries_celery_queues_batches_and_rollup_lag(client):
    import redis

    broker = redis.Redis.from_url(settings.CELERY_BROKER_URL)
    broker.delete("celery")
    broker.rpush("celery", "m1", "m2")
    try:
        UsageRecord.objects.create(user=_user(), source="api", model="m")
        UsageRecord.objects.update(created_at=timezone.now() - timedelta(hours=3))
        from dashboard import services

        services.roll_up_usage()
        text = client.get("/metrics").content.decode()
    finally:
        broker.delete("celery")
    assert 'tessera_celery_queue_length{queue="celery"} 2' in text
    assert 'tessera_batches{status="in_progress"} 0' in text
    lag = float(
        next(line for line in text.splitlines() if line.startswith("tessera_usage_rollup_lag_seconds ")).split()[1]
    )
    assert 0 <= lag <= 3600
