"""Batch lines draw on the user's token budget only.

A batch is background work: it must not take the user's requests-per-minute or concurrency
slots (that would lock their own chat out while a batch runs), so lines reserve tokens against
the plan's daily and monthly budgets through the same atomic Redis ledger, with the rate limits
left out. When the budget is spent the batch pauses (it does not fail) until it resets.
"""
from __future__ import annotations

import dataclasses

from quotas.ledger import QuotaLedger, Reservation
from quotas.selectors import get_ledger, plan_for
from quotas.services import check_plan

SOURCE = "batch"


class BudgetSpent(Exception):
    def __init__(self, reason: str, retry_after_s: int):
        super().__init__(reason)
        self.reason = reason
        self.retry_after_s = retry_after_s


class BatchLedger(QuotaLedger):
    """The shared ledger, except that batch admissions are counted in their own rate/concurrency
    sets (the ledger always records them), so they never crowd the user's interactive requests."""

    def user_keys(self, user_id: int, now=None) -> dict[str, str]:
        keys = super().user_keys(user_id, now)
        return {**keys, "rpm": keys["rpm"] + ":batch", "conc": keys["conc"] + ":batch"}


_ledgers: dict[int, BatchLedger] = {}


def batch_ledger() -> BatchLedger:
    shared = get_ledger()
    key = id(shared)
    if key not in _ledgers:
        _ledgers[key] = BatchLedger(shared.redis, prefix=shared.prefix, lease_seconds=shared.lease_ms // 1000)
    return _ledgers[key]


def token_budget_plan(user):
    return dataclasses.replace(plan_for(user), requests_per_minute=None, concurrent_requests=None)


def reserve_line(user, plan, model: str, prompt_tokens: int, max_tokens: int) -> Reservation:
    """Reserve prompt + max_tokens; raises BudgetSpent, or quotas' PlanViolation for a line the plan forbids."""
    check_plan(plan, model, max_tokens)
    outcome = batch_ledger().reserve(user.pk, plan, prompt_tokens + max_tokens, model=model, source=SOURCE,
                                   prompt_tokens=prompt_tokens, max_tokens=max_tokens)
    if isinstance(outcome, Reservation):
        return outcome
    which = "daily" if outcome.limit == "tokens_per_day" else "monthly"
    raise BudgetSpent(f"Paused: the {which} token budget is spent; the batch resumes when it resets "
                      f"(in about {outcome.retry_after_s}s).", outcome.retry_after_s)


def settle_line(reservation: dict | None, prompt_tokens: int, completion_tokens: int) -> None:
    if reservation:
        batch_ledger().settle(Reservation.from_dict(reservation), int(prompt_tokens) + int(completion_tokens))


__all__ = ["BudgetSpent", "reserve_line", "settle_line", "token_budget_plan"]
