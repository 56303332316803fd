"""The one place that knows usage.UsageRecord's field names (the usage app is another team's).

Everything else in the dashboard works on aggregate.UsageRow, so a change in the usage model is a
change here only.
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import datetime

from usage.models import UsageRecord

from .aggregate import UsageRow

TIME_FIELD = "created_at"
# Dashboard filter name -> UsageRecord lookup.
FILTERS = {"user_id": "user_id", "api_key_id": "api_key_id", "model": "model", "source": "source"}
_VALUES = (
    "created_at",
    "user_id",
    "api_key_id",
    "model",
    "source",
    "status_code",
    "prompt_tokens",
    "completion_tokens",
    "cached_tokens",
    "ttft_ms",
    "latency_ms",
)


def records_between(start: datetime | None, end: datetime | None, **filters):
    qs = UsageRecord.objects.all()
    if start is not None:
        qs = qs.filter(**{f"{TIME_FIELD}__gte": start})
    if end is not None:
        qs = qs.filter(**{f"{TIME_FIELD}__lt": end})
    return qs.filter(**{FILTERS[k]: v for k, v in filters.items()})


def rows_between(start: datetime | None, end: datetime | None, **filters) -> Iterator[UsageRow]:
    qs = records_between(start, end, **filters).order_by(TIME_FIELD).values_list(*_VALUES)
    for values in qs.iterator(chunk_size=5000):
        yield _row(*values)


def first_record_time() -> datetime | None:
    return UsageRecord.objects.order_by(TIME_FIELD).values_list(TIME_FIELD, flat=True).first()


def _row(
    created_at,
    user_id,
    api_key_id,
    model,
    source,
    status_code,
    prompt_tokens,
    completion_tokens,
    cached_tokens,
    ttft_ms,
    latency_ms,
) -> UsageRow:
    return UsageRow(
        created_at=created_at,
        user_id=user_id,
        api_key_id=api_key_id,
        model=model or "",
        source=source or "",
        status=int(status_code or 200),
        prompt_tokens=prompt_tokens or 0,
        completion_tokens=completion_tokens or 0,
        cached_tokens=cached_tokens or 0,
        ttft_ms=ttft_ms,
        latency_ms=latency_ms,
    )


def api_key_labels(key_ids) -> dict[int, dict]:
    """key id -> {"label": "tsk-ab12cd34… (name)", "username": owner}; only the visible prefix, never the key."""
    from accounts.models import ApiKey

    keys = ApiKey.objects.filter(pk__in=list(key_ids)).select_related("user")
    return {
        k.pk: {
            "label": f"{k.prefix}… ({k.name or 'unnamed'})",
            "username": k.user.get_username(),
            "revoked": k.is_revoked,
        }
        for k in keys
    }
