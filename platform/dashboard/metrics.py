"""Lines the dashboard adds to GET /metrics (openai_api.metrics.EXTRA_COLLECTORS): Celery queue
lengths, batches by status and the usage roll-up's lag. Registered in DashboardConfig.ready()."""

from __future__ import annotations

import logging
import time

from celery import current_app
from django.conf import settings

from common import connections

# kombu's Redis transport keeps a queue's messages of priority p > 0 under "<queue>\x06\x16<p>".
_PRIORITY_SEP = "\x06\x16"
_PRIORITY_STEPS = (0, 3, 6, 9)
log = logging.getLogger(__name__)


def celery_queue_names() -> list[str]:
    names = {current_app.conf.task_default_queue or "celery"}
    for route in (getattr(settings, "CELERY_TASK_ROUTES", None) or {}).values():
        if isinstance(route, dict) and route.get("queue"):
            names.add(route["queue"])
    return sorted(names)


def celery_queue_lengths() -> dict[str, int]:
    pipe = connections.broker_redis().pipeline(transaction=False)
    names = celery_queue_names()
    for name in names:
        for step in _PRIORITY_STEPS:
            pipe.llen(name if step == 0 else f"{name}{_PRIORITY_SEP}{step}")
    lengths = pipe.execute()
    per = len(_PRIORITY_STEPS)
    return {name: sum(lengths[i * per : (i + 1) * per]) for i, name in enumerate(names)}


def collect() -> list[str]:
    lines: list[str] = []
    for part in (_celery_lines, _batch_lines, _rollup_lines):
        try:
            lines += part()
        except Exception as exc:  # one broken source must not take the whole scrape down
            log.warning("metrics: %s failed: %s", part.__name__, exc)
    return lines


def _celery_lines() -> list[str]:
    lines = [
        "# HELP tessera_celery_queue_length Tasks waiting in each Celery queue.",
        "# TYPE tessera_celery_queue_length gauge",
    ]
    return lines + [f'tessera_celery_queue_length{{queue="{q}"}} {n}' for q, n in celery_queue_lengths().items()]


def _batch_lines() -> list[str]:
    from django.db.models import Count

    from batches.models import Batch

    counts = dict(Batch.objects.order_by().values_list("status").annotate(n=Count("id")))
    lines = ["# HELP tessera_batches Batches by status.", "# TYPE tessera_batches gauge"]
    return lines + [f'tessera_batches{{status="{s}"}} {counts.get(s, 0)}' for s in Batch.Status.values]


def _rollup_lines() -> list[str]:
    from .models import RollupState

    rolled = RollupState.objects.filter(name="usage").values_list("rolled_until", flat=True).first()
    lag = time.time() - rolled.timestamp() if rolled else -1
    return [
        "# HELP tessera_usage_rollup_lag_seconds Seconds of usage not yet rolled up (-1: never ran).",
        "# TYPE tessera_usage_rollup_lag_seconds gauge",
        f"tessera_usage_rollup_lag_seconds {lag:.0f}",
    ]
