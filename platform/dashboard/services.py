"""Writes: rolling usage records up into UsageHourly (idempotent: each hour is rebuilt whole)."""

from __future__ import annotations

from datetime import datetime, timedelta

from django.db import transaction
from django.utils import timezone

from . import usage_source
from .aggregate import Cell, floor_hour, fold, merge_hists
from .models import LatencyHourly, RollupState, UsageHourly

HOUR = timedelta(hours=1)
# Hours already rolled up that are rebuilt on every run, for usage rows committed late (a long
# request is recorded when it finishes, possibly after its hour was rolled up).
LOOKBACK_HOURS = 2


def roll_up_usage(now: datetime | None = None, lookback_hours: int = LOOKBACK_HOURS) -> dict:
    """Rebuild the roll-ups of every complete hour not rolled up yet (plus a short lookback).

    Running it twice, or from two workers at once, gives the same rows: each hour is deleted and
    rebuilt from the usage records in one transaction. Returns what it did, for the task's log.
    """
    until = floor_hour(now or timezone.now())
    with transaction.atomic():
        state, _ = RollupState.objects.select_for_update().get_or_create(name="usage")
        start = _first_hour_to_build(state, until, lookback_hours)
        if start is None or start >= until:
            return {"hours": 0, "rows": 0, "rolled_until": until.isoformat()}
        cells = fold(usage_source.rows_between(start, until))
        UsageHourly.objects.filter(hour__gte=start, hour__lt=until).delete()
        UsageHourly.objects.bulk_create((_to_model(key, cell) for key, cell in cells.items()), batch_size=2000)
        LatencyHourly.objects.filter(hour__gte=start, hour__lt=until).delete()
        LatencyHourly.objects.bulk_create(_latency_rows(cells), batch_size=2000)
        state.rolled_until = until
        state.save(update_fields=["rolled_until", "updated_at"])
    return {"hours": int((until - start) / HOUR), "rows": len(cells), "rolled_until": until.isoformat()}


def _first_hour_to_build(state: RollupState, until: datetime, lookback_hours: int) -> datetime | None:
    if state.rolled_until is not None:
        return min(state.rolled_until, until) - lookback_hours * HOUR
    first = usage_source.first_record_time()
    return floor_hour(first) if first is not None else until


def _to_model(key, cell: Cell) -> UsageHourly:
    hour, user_id, api_key_id, model, source = key
    return UsageHourly(
        hour=hour,
        user_id=user_id,
        api_key_id=api_key_id,
        model=model,
        source=source,
        requests=cell.requests,
        errors=cell.errors,
        rate_limited=cell.rate_limited,
        prompt_tokens=cell.prompt_tokens,
        completion_tokens=cell.completion_tokens,
        cached_tokens=cell.cached_tokens,
        ttft_ms_sum=cell.ttft_ms_sum,
        latency_ms_sum=cell.latency_ms_sum,
        ttft_hist=cell.ttft_hist,
        tpot_hist=cell.tpot_hist,
        latency_hist=cell.latency_hist,
    )


def _latency_rows(cells) -> list[LatencyHourly]:
    coarse: dict[tuple, Cell] = {}
    for (hour, _user, _key, model, source), cell in cells.items():
        merge_hists(coarse.setdefault((hour, model, source), Cell()), cell)
    return [
        LatencyHourly(
            hour=hour,
            model=model,
            source=source,
            ttft_hist=c.ttft_hist,
            tpot_hist=c.tpot_hist,
            latency_hist=c.latency_hist,
        )
        for (hour, model, source), c in coarse.items()
    ]


def reset_rollups() -> None:
    """Forget every roll-up (the next run rebuilds from the first usage record)."""
    with transaction.atomic():
        UsageHourly.objects.all().delete()
        LatencyHourly.objects.all().delete()
        RollupState.objects.filter(name="usage").delete()
