"""Writes: admit a request against the user's plan (reserve), charge what it really used (settle).

Every entry point (playground, /v1, batches) calls reserve() before queueing work and settle()
when the work ends for any reason (finished, aborted, stream cut). settle() is idempotent; one that
Redis was away for is applied as soon as Redis answers again (before this process's next admission),
and a reservation that is never settled still frees its concurrency slot when its lease expires.
"""

from __future__ import annotations

import dataclasses

from errors import PlanViolation, QuotaExceeded

from .ledger import BACKGROUND_SOURCES, Reservation
from .limits import PlanLimits
from .selectors import get_ledger, headers_for, plan_for, quota_status, rate_limit_headers

__all__ = ["reserve", "settle", "renew", "rate_limit_headers", "QuotaExceeded", "PlanViolation", "Reservation"]

REFUSAL_CODES = {
    "requests_per_minute": "rate_limit_exceeded",
    "concurrent_requests": "rate_limit_exceeded",
    "tokens_per_day": "insufficient_quota",
    "tokens_per_month": "insufficient_quota",
}
REFUSAL_MESSAGES = {
    "requests_per_minute": "Rate limit reached: {limit} requests per minute. Try again in {retry}s.",
    "concurrent_requests": "Too many concurrent requests: at most {limit} at a time. Try again in {retry}s.",
    "tokens_per_day": "Daily token quota exhausted ({limit} tokens per day, this request needs {tokens}). "
    "It resets in {retry}s.",
    "tokens_per_month": "Monthly token quota exhausted ({limit} tokens per month, this request needs "
    "{tokens}). It resets in {retry}s.",
}


def check_plan(plan: PlanLimits, model: str, max_tokens: int) -> None:
    """Refuse requests the plan can never admit (not retryable, so not a 429)."""
    if not plan.allows_model(model):
        raise PlanViolation(
            f"Your plan does not include the model '{model}'.", code="model_not_allowed", param="model", status=403
        )
    if plan.max_tokens_per_request is not None and max_tokens > plan.max_tokens_per_request:
        raise PlanViolation(
            f"max_tokens is {max_tokens}, but your plan allows at most {plan.max_tokens_per_request} per request.",
            code="max_tokens_exceeded",
            param="max_tokens",
        )


def reserve(user, model: str, prompt_tokens: int, max_tokens: int, source: str, plan=None) -> Reservation:
    """Admit one request and reserve prompt_tokens + max_tokens; raises QuotaExceeded or PlanViolation.

    `plan` saves the database lookup when the caller already has the user's PlanLimits. A batch
    line (a background source) draws on the token budgets only: it must not take the user's
    requests-per-minute or concurrency slots, or a running batch would lock their own chat out."""
    plan = plan or plan_for(user)
    check_plan(plan, model, max_tokens)
    if source in BACKGROUND_SOURCES:
        plan = dataclasses.replace(plan, requests_per_minute=None, concurrent_requests=None)
    tokens = int(prompt_tokens) + int(max_tokens)
    outcome = get_ledger().reserve(
        user.pk, plan, tokens, model=model, source=source, prompt_tokens=int(prompt_tokens), max_tokens=int(max_tokens)
    )
    if isinstance(outcome, Reservation):
        return outcome
    limit_value = getattr(plan, outcome.limit)
    message = REFUSAL_MESSAGES[outcome.limit].format(limit=limit_value, retry=outcome.retry_after_s, tokens=tokens)
    raise QuotaExceeded(
        message,
        code=REFUSAL_CODES[outcome.limit],
        retry_after=outcome.retry_after_s,
        headers=headers_for(quota_status(user, plan)),
        limit=outcome.limit,
    )


def settle(reservation: Reservation, prompt_tokens: int, completion_tokens: int) -> bool:
    """Charge the actual usage and free the concurrency slot. Idempotent: True only the first time."""
    return get_ledger().settle(reservation, int(prompt_tokens) + int(completion_tokens))


def renew(reservation: Reservation) -> bool:
    """Extend the concurrency lease of a long-running request (call every ~30 s while streaming)."""
    return get_ledger().renew(reservation)
