"""Reads: a user's plan, live usage and remaining quota, and the x-ratelimit-* headers."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timezone

from django.conf import settings

from common import connections

from .ledger import QuotaLedger, Usage, seconds_until_next_day
from .limits import PlanLimits
from .models import UserPlan

_ledgers: dict[tuple, QuotaLedger] = {}


def get_ledger() -> QuotaLedger:
    """One ledger per prefix and lease, on this process's Redis connection."""
    prefix = getattr(settings, "QUOTA_REDIS_PREFIX", "quota")
    lease = getattr(settings, "QUOTA_LEASE_SECONDS", 120)
    key = (prefix, lease)
    if key not in _ledgers:
        _ledgers[key] = QuotaLedger(connections.sync_redis(), prefix=prefix, lease_seconds=lease)
    return _ledgers[key]


def plan_for(user) -> PlanLimits:
    """The user's assigned plan, else settings.QUOTA_DEFAULT_PLAN."""
    assigned = UserPlan.objects.select_related("plan").filter(user_id=user.pk).first()
    if assigned is None:
        return PlanLimits.from_mapping(getattr(settings, "QUOTA_DEFAULT_PLAN", {}))
    plan = assigned.plan
    return PlanLimits(
        name=plan.name,
        tokens_per_day=plan.tokens_per_day,
        tokens_per_month=plan.tokens_per_month,
        requests_per_minute=plan.requests_per_minute,
        concurrent_requests=plan.concurrent_requests,
        max_tokens_per_request=plan.max_tokens_per_request,
        allowed_models=tuple(plan.allowed_models or ()),
        share=plan.share,
    )


@dataclass(frozen=True)
class QuotaStatus:
    plan: PlanLimits
    usage: Usage

    @staticmethod
    def _left(limit: int | None, used: int) -> int | None:
        return None if limit is None else max(0, limit - used)

    @property
    def requests_remaining(self) -> int | None:
        return self._left(self.plan.requests_per_minute, self.usage.requests_last_minute)

    @property
    def concurrent_remaining(self) -> int | None:
        return self._left(self.plan.concurrent_requests, self.usage.concurrent)

    @property
    def tokens_remaining_today(self) -> int | None:
        return self._left(self.plan.tokens_per_day, self.usage.tokens_today)

    @property
    def tokens_remaining_this_month(self) -> int | None:
        return self._left(self.plan.tokens_per_month, self.usage.tokens_this_month)

    @property
    def tokens_remaining(self) -> int | None:
        """The tighter of the daily and monthly budgets."""
        left = [v for v in (self.tokens_remaining_today, self.tokens_remaining_this_month) if v is not None]
        return min(left) if left else None


def quota_status(user, plan: PlanLimits | None = None) -> QuotaStatus:
    """The user's limits and live usage; pass `plan` when the caller already looked it up."""
    return QuotaStatus(plan=plan or plan_for(user), usage=get_ledger().usage(user.pk))


def format_reset(seconds: float) -> str:
    """OpenAI's reset format: 1s, 6m0s, 3h2m1s."""
    seconds = max(0, int(round(seconds)))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h{minutes}m{secs}s"
    if minutes:
        return f"{minutes}m{secs}s"
    return f"{secs}s"


def headers_for(status: QuotaStatus) -> dict[str, str]:
    headers: dict[str, str] = {}
    if status.plan.requests_per_minute is not None:
        headers["x-ratelimit-limit-requests"] = str(status.plan.requests_per_minute)
        headers["x-ratelimit-remaining-requests"] = str(status.requests_remaining)
        headers["x-ratelimit-reset-requests"] = format_reset(status.usage.requests_reset_s)
    token_limit = status.plan.tokens_per_day if status.plan.tokens_per_day is not None else status.plan.tokens_per_month
    if token_limit is not None:
        headers["x-ratelimit-limit-tokens"] = str(token_limit)
        headers["x-ratelimit-remaining-tokens"] = str(status.tokens_remaining)
        headers["x-ratelimit-reset-tokens"] = format_reset(seconds_until_next_day(datetime.now(timezone.utc)))
    return headers


def rate_limit_headers(user, plan: PlanLimits | None = None, usage: Usage | None = None) -> dict[str, str]:
    """x-ratelimit-* headers for every /v1 response (unlimited limits are left out). `usage`: the
    counters an admission just read (Reservation.usage), so no second round trip to Redis."""
    if usage is not None and plan is not None:
        return headers_for(QuotaStatus(plan=plan, usage=usage))
    return headers_for(quota_status(user, plan))
