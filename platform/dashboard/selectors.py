"""Reads for the dashboard: usage, latency, errors, batches and quotas over a time window.

Usage comes from two places joined at the roll-up watermark (RollupState.rolled_until): the
UsageHourly roll-ups before it and the raw usage records after it (the current hour, and any
hour the periodic roll-up has not reached yet), folded with the same code the roll-up uses.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from datetime import timezone as dt_timezone

from django.contrib.auth import get_user_model
from django.db.models import Count, Sum
from django.utils import timezone

from . import histogram, usage_source
from .aggregate import HIST_FIELDS, SUM_FIELDS, Cell, fold, merge_hists, merge_sums
from .models import LatencyHourly, RollupState, UsageHourly

BUCKETS = {"hour": timedelta(hours=1), "day": timedelta(days=1)}
RANGES = {"24h": (timedelta(hours=24), "hour"), "7d": (timedelta(days=7), "hour"), "30d": (timedelta(days=30), "day")}
DIMENSIONS = ("user_id", "api_key_id", "model", "source")
COARSE = {"bucket", "model", "source"}  # what LatencyHourly can group and filter by
NEAR_QUOTA = 0.8  # a user at 80% of a token budget is "near" it
LATENCY_METRICS = {"ttft": "ttft_hist", "tpot": "tpot_hist", "latency": "latency_hist"}


# ---------------------------------------------------------------- windows


@dataclass(frozen=True)
class Window:
    """[start, end) cut into `bucket`-sized steps, all UTC."""

    start: datetime
    end: datetime
    bucket: str = "hour"

    def buckets(self) -> list[datetime]:
        step, at, out = BUCKETS[self.bucket], self.start, []
        while at < self.end:
            out.append(at)
            at += step
        return out


def floor_to(moment: datetime, bucket: str) -> datetime:
    moment = moment.astimezone(dt_timezone.utc).replace(minute=0, second=0, microsecond=0)
    return moment.replace(hour=0) if bucket == "day" else moment


def window_for(range_key: str = "24h", bucket: str | None = None, now: datetime | None = None) -> Window:
    """The last `range_key` (24h / 7d / 30d) up to and including the current hour or day."""
    span, default_bucket = RANGES[range_key]
    bucket = bucket if bucket in BUCKETS else default_bucket
    end = floor_to(now or timezone.now(), bucket) + BUCKETS[bucket]
    return Window(start=end - span, end=end, bucket=bucket)


def _split(window: Window) -> datetime:
    """Where roll-ups stop and raw records take over, clamped into the window."""
    rolled = RollupState.objects.filter(name="usage").values_list("rolled_until", flat=True).first()
    if rolled is None:
        return window.start
    return min(max(rolled, window.start), window.end)


# ---------------------------------------------------------------- the core fold


def grouped(window: Window, dims: tuple[str, ...] = (), *, hists: bool = False, **filters) -> dict[tuple, Cell]:
    """Usage in the window grouped by `dims` (any of "bucket", user_id, api_key_id, model, source).

    Sums are aggregated by the database; latency histograms (hists=True) are merged in Python,
    from LatencyHourly when the grouping and filters need no user or key (the overview), else
    from the per-user rows.
    """
    split = _split(window)
    out: dict[tuple, Cell] = {}
    # Rows are grouped by their hour in the database and folded into day buckets here (cheap:
    # at most one row per hour and dimension value), which needs no date functions in SQL.
    db_dims = tuple("hour" if d == "bucket" else d for d in dims)

    def cell_for(row) -> Cell:
        key = tuple(floor_to(row["hour"], window.bucket) if d == "bucket" else row[d] for d in dims)
        return out.setdefault(key, Cell())

    qs = UsageHourly.objects.filter(hour__gte=window.start, hour__lt=split, **filters)
    coarse = hists and set(dims) <= COARSE and set(filters) <= COARSE
    if hists and not coarse:  # per user or key: that user's rows are few
        for row in qs.values(*db_dims, *SUM_FIELDS, *HIST_FIELDS).iterator(chunk_size=2000):
            merge_hists(merge_sums(cell_for(row), row), row)
    elif dims:
        for row in qs.order_by().values(*db_dims).annotate(**{f: Sum(f) for f in SUM_FIELDS}):
            merge_sums(cell_for(row), row)
    else:
        merge_sums(out.setdefault((), Cell()), qs.aggregate(**{f: Sum(f) for f in SUM_FIELDS}))
    if coarse:
        latency = LatencyHourly.objects.filter(hour__gte=window.start, hour__lt=split, **filters)
        for row in latency.values(*db_dims, *HIST_FIELDS).iterator(chunk_size=2000):
            merge_hists(cell_for(row), row)
    for key, cell in fold(usage_source.rows_between(split, window.end, **filters)).items():
        hour, user_id, api_key_id, model, source = key
        named = {
            "bucket": floor_to(hour, window.bucket),
            "user_id": user_id,
            "api_key_id": api_key_id,
            "model": model,
            "source": source,
        }
        target = out.setdefault(tuple(named[d] for d in dims), Cell())
        merge_sums(target, cell)
        if hists:
            merge_hists(target, cell)
    return out


def _counters(cell: Cell) -> dict:
    requests = cell.requests
    return {
        "requests": requests,
        "prompt_tokens": cell.prompt_tokens,
        "completion_tokens": cell.completion_tokens,
        "cached_tokens": cell.cached_tokens,
        "total_tokens": cell.prompt_tokens + cell.completion_tokens,
        "errors": cell.errors,
        "rate_limited": cell.rate_limited,
        "error_rate": round(cell.errors / requests, 4) if requests else 0.0,
        "rate_limited_rate": round(cell.rate_limited / requests, 4) if requests else 0.0,
    }


def _latency(cell: Cell) -> dict:
    served = histogram.total(cell.latency_hist)
    ttft_n = histogram.total(cell.ttft_hist)
    return {
        "ttft": {
            **histogram.quantiles(cell.ttft_hist),
            "mean": round(cell.ttft_ms_sum / ttft_n, 2) if ttft_n else None,
        },
        "tpot": histogram.quantiles(cell.tpot_hist),
        "latency": {
            **histogram.quantiles(cell.latency_hist),
            "mean": round(cell.latency_ms_sum / served, 2) if served else None,
        },
    }


# ---------------------------------------------------------------- usage


def totals(window: Window, **filters) -> dict:
    cell = grouped(window, (), hists=True, **filters).get((), Cell())
    return {**_counters(cell), "latency": _latency(cell)}


def usage_over_time(window: Window, **filters) -> list[dict]:
    """One entry per bucket (empty buckets included): tokens, requests, errors and 429 rates."""
    cells = grouped(window, ("bucket",), **filters)
    return [{"t": at.isoformat(), **_counters(cells.get((at,), Cell()))} for at in window.buckets()]


def usage_over_time_by(window: Window, dim: str, **filters) -> dict:
    """{"labels": [bucket...], "series": {value: {"tokens": [...], "requests": [...]}}} for stacked charts."""
    _check_dim(dim)
    cells = grouped(window, ("bucket", dim), **filters)
    at_index = {at: i for i, at in enumerate(window.buckets())}
    series: dict[str, dict] = {}
    for (at, value), cell in sorted(cells.items(), key=lambda kv: str(kv[0][1])):
        line = series.setdefault(str(value), {"tokens": [0] * len(at_index), "requests": [0] * len(at_index)})
        line["tokens"][at_index[at]] += cell.prompt_tokens + cell.completion_tokens
        line["requests"][at_index[at]] += cell.requests
    return {"labels": [at.isoformat() for at in window.buckets()], "series": series}


def breakdown(window: Window, dim: str, **filters) -> list[dict]:
    """Totals per model / source / user / key, most tokens first."""
    _check_dim(dim)
    rows = [{dim: key[0], **_counters(cell)} for key, cell in grouped(window, (dim,), **filters).items()]
    return sorted(rows, key=lambda r: (-r["total_tokens"], -r["requests"], str(r[dim])))


def top_users(window: Window, limit: int = 10, **filters) -> list[dict]:
    rows = [r for r in breakdown(window, "user_id", **filters) if r["user_id"] is not None][:limit]
    names = dict(get_user_model().objects.filter(pk__in=[r["user_id"] for r in rows]).values_list("pk", "username"))
    return [{**r, "username": names.get(r["user_id"], f"#{r['user_id']}")} for r in rows]


def top_api_keys(window: Window, limit: int = 10, **filters) -> list[dict]:
    rows = [r for r in breakdown(window, "api_key_id", **filters) if r["api_key_id"] is not None][:limit]
    labels = usage_source.api_key_labels([r["api_key_id"] for r in rows])
    return [{**r, **labels.get(r["api_key_id"], {"label": f"key #{r['api_key_id']}", "username": ""})} for r in rows]


def _check_dim(dim: str) -> None:
    if dim not in DIMENSIONS:
        raise ValueError(f"unknown dimension {dim!r}")


# ---------------------------------------------------------------- latency


def latency_over_time(window: Window, **filters) -> list[dict]:
    """Per bucket: TTFT, time per output token and end-to-end latency p50/p95/p99 (ms)."""
    cells = grouped(window, ("bucket",), hists=True, **filters)
    return [{"t": at.isoformat(), **_latency(cells.get((at,), Cell()))} for at in window.buckets()]


# ---------------------------------------------------------------- one user


def user_drilldown(user, window: Window) -> dict:
    return {
        "user": {"id": user.pk, "username": user.get_username(), "email": getattr(user, "email", "")},
        "totals": totals(window, user_id=user.pk),
        "over_time": usage_over_time(window, user_id=user.pk),
        "by_model": breakdown(window, "model", user_id=user.pk),
        "by_source": breakdown(window, "source", user_id=user.pk),
        "api_keys": top_api_keys(window, limit=50, user_id=user.pk),
        "latency_over_time": latency_over_time(window, user_id=user.pk),
        "quota": quota_of(user),
    }


# ---------------------------------------------------------------- quotas


def usernames(*, user_ids: list[str]) -> dict[str, str]:
    """{str(user id): username} for the ids that are users (the engine's tenants are user ids as text)."""
    ids = [int(i) for i in user_ids if str(i).isdigit()]
    if not ids:
        return {}
    users = get_user_model().objects.filter(pk__in=ids)
    return {str(user.pk): user.get_username() for user in users}


def _budget_windows(now: datetime) -> tuple[Window, Window]:
    day = floor_to(now, "day")
    month = day.replace(day=1)
    return Window(day, day + timedelta(days=1), "day"), Window(month, day + timedelta(days=1), "day")


def quota_of(user, now: datetime | None = None) -> dict:
    """The user's plan and tokens used today / this month (from usage), with the fraction used."""
    from quotas.selectors import plan_for  # the quotas app owns plans

    now = now or timezone.now()
    today, month = _budget_windows(now)
    used_day = grouped(today, (), user_id=user.pk).get((), Cell())
    used_month = grouped(month, (), user_id=user.pk).get((), Cell())
    return _quota_row(
        user,
        plan_for(user),
        used_day.prompt_tokens + used_day.completion_tokens,
        used_month.prompt_tokens + used_month.completion_tokens,
    )


def _quota_row(user, plan, tokens_today: int, tokens_month: int) -> dict:
    day_frac = tokens_today / plan.tokens_per_day if plan.tokens_per_day else None
    month_frac = tokens_month / plan.tokens_per_month if plan.tokens_per_month else None
    worst = max([f for f in (day_frac, month_frac) if f is not None], default=None)
    return {
        "user_id": user.pk,
        "username": user.get_username(),
        "plan": plan.name,
        "tokens_today": tokens_today,
        "tokens_per_day": plan.tokens_per_day,
        "tokens_this_month": tokens_month,
        "tokens_per_month": plan.tokens_per_month,
        "day_used": None if day_frac is None else round(day_frac, 4),
        "month_used": None if month_frac is None else round(month_frac, 4),
        "used": None if worst is None else round(worst, 4),
        "state": _quota_state(worst),
    }


def _quota_state(used: float | None, near: float = NEAR_QUOTA) -> str:
    if used is None:
        return "unlimited"
    return "over" if used >= 1 else "near" if used >= near else "ok"


def users_near_quota(threshold: float = NEAR_QUOTA, now: datetime | None = None) -> list[dict]:
    """Users whose daily or monthly token use is at least `threshold` of their plan, worst first."""
    from quotas.selectors import plan_for

    now = now or timezone.now()
    today, month = _budget_windows(now)
    by_day = grouped(today, ("user_id",))
    by_month = grouped(month, ("user_id",))
    users = get_user_model().objects.filter(pk__in=[k[0] for k in by_month if k[0] is not None])
    rows = []
    for user in users:
        d, m = by_day.get((user.pk,), Cell()), by_month.get((user.pk,), Cell())
        row = _quota_row(
            user, plan_for(user), d.prompt_tokens + d.completion_tokens, m.prompt_tokens + m.completion_tokens
        )
        if row["used"] is not None and row["used"] >= threshold:
            rows.append({**row, "state": _quota_state(row["used"], threshold)})
    return sorted(rows, key=lambda r: -r["used"])


# ---------------------------------------------------------------- batches


def batch_summary(now: datetime | None = None, rate_window_s: int = 60) -> dict:
    """Batches by status, lines finished per second lately, and the oldest batch still running."""
    from batches.models import Batch, BatchLine  # the batches app owns these

    now = now or timezone.now()
    by_status = dict(Batch.objects.order_by().values_list("status").annotate(n=Count("id")))
    finished = BatchLine.objects.filter(finished_at__gte=now - timedelta(seconds=rate_window_s)).count()
    running = (
        Batch.objects.filter(status__in=[Batch.Status.IN_PROGRESS, Batch.Status.FINALIZING, Batch.Status.CANCELLING])
        .select_related("user")
        .order_by("in_progress_at", "created_at")
        .first()
    )
    oldest = None
    if running is not None:
        since = running.in_progress_at or running.created_at
        oldest = {
            "id": running.public_id,
            "user": running.user.get_username(),
            "status": running.status,
            "since": since.isoformat(),
            "age_s": round((now - since).total_seconds()),
            "total": running.total,
            "completed": running.completed,
            "failed": running.failed,
            "paused_reason": running.paused_reason,
        }
    return {
        "by_status": {s: by_status.get(s, 0) for s in Batch.Status.values},
        "lines_per_s": round(finished / rate_window_s, 3),
        "oldest_running": oldest,
    }
