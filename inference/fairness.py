"""Fair share between tenants: the Virtual Token Counter of Sheng et al., "Fairness in Serving Large
Language Models" (OSDI 2024).

Each tenant's counter grows by the service it gets, divided by its weight: prompt tokens x1 as their
prefill is computed, output tokens x2 as they are sampled. The `fair` policy (scheduling_policy.py)
admits from the backlogged tenant with the smallest counter, and a tenant that becomes active again is
lifted to the smallest counter of the active tenants, so it cannot bank credit while idle. Between two
continuously backlogged tenants the difference in weighted service then stays within 2U
(`service_bound`), also with the seat moves the policy adds to the paper (`seat_slack`).

A request with no tenant is its own tenant. The counters also keep a one-minute window of raw service
per tenant for the dashboard's share panel (top tenants, the rest summed, so label counts stay bounded).
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Hashable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from inference.request import Request

PROMPT_TOKEN_COST = 1.0  # w_p: a prefilled prompt token
OUTPUT_TOKEN_COST = 2.0  # w_q: a sampled output token (decode is the dearer half of serving)
SHARE_WINDOW_S = 60
TOP_TENANTS = 5


def check_weight(weight) -> float:
    """A tenant's weight as a float; ValueError unless it is a positive, finite number."""
    if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not math.isfinite(weight) or weight <= 0:
        raise ValueError(f"weight must be a positive number; got {weight!r}")
    return float(weight)


def service_bound(max_prompt_tokens: int, kv_capacity_tokens: int) -> float:
    """The paper's 2U: the most the weighted service of two continuously backlogged tenants may differ by,
    U = max(w_p x longest prompt, w_q x KV capacity in tokens)."""
    return 2 * max(PROMPT_TOKEN_COST * max_prompt_tokens, OUTPUT_TOKEN_COST * kv_capacity_tokens)


def seat_slack(request: Request) -> float:
    """How far a waiting request's tenant may be ahead and still take a seat in a full batch
    (scheduling_policy.FairPolicy): what this request's prompt will be charged, in counter units.

    It keeps the bound: after a tenant's last admission its counter grows by at most what the requests it
    then holds are charged, and U prices every token they hold at the output rate (w_q); this request's
    prompt tokens are charged w_p, and as w_q >= 2 w_p the headroom left covers the slack, so backlogged
    tenants' counters still stay within U of each other. A recompute's prompt was charged already: no slack.
    """
    unserved = max(0, request.num_prompt_tokens - request.served_prompt_tokens)
    return PROMPT_TOKEN_COST * unserved / request.weight


def new_prompt_tokens(request: Request, num_new: int) -> int:
    """Prompt positions that computing num_new more tokens serves for the first time: a prefix-cache hit
    is not computed, and a recompute after preemption was charged already."""
    start = max(request.num_computed_tokens, request.served_prompt_tokens)
    return max(0, min(request.num_computed_tokens + num_new, request.num_prompt_tokens) - start)


class ServiceWindow:
    """Raw service (prompt x1 + output x2 tokens) per tenant over the last `seconds`, in one-second buckets."""

    def __init__(self, seconds: int = SHARE_WINDOW_S, clock=time.monotonic):
        self.seconds = seconds
        self.clock = clock
        self.buckets: deque[tuple[int, dict[str | None, float]]] = deque()
        self.weights: dict[str | None, float] = {}

    def add(self, tenant: str | None, tokens: float, weight: float) -> None:
        now = int(self.clock())
        if not self.buckets or self.buckets[-1][0] != now:
            self.buckets.append((now, {}))
            self._expire(now)
        bucket = self.buckets[-1][1]
        bucket[tenant] = bucket.get(tenant, 0.0) + tokens
        self.weights[tenant] = weight

    def _expire(self, now: int) -> None:
        while self.buckets and self.buckets[0][0] <= now - self.seconds:
            self.buckets.popleft()

    def shares(self, top: int = TOP_TENANTS) -> dict:
        """The `top` named tenants by service with their share and weight; everyone else (including
        requests without a tenant) summed in `others`."""
        self._expire(int(self.clock()))
        totals: dict[str | None, float] = {}
        for _, bucket in self.buckets:
            for tenant, tokens in bucket.items():
                totals[tenant] = totals.get(tenant, 0.0) + tokens
        self.weights = {tenant: w for tenant, w in self.weights.items() if tenant in totals}
        total = sum(totals.values())
        named = sorted(((tokens, tenant) for tenant, tokens in totals.items() if tenant is not None), reverse=True)
        shown = [
            {"tenant": tenant, "tokens": round(tokens), "share": tokens / total, "weight": self.weights[tenant]}
            for tokens, tenant in named[:top]
        ]
        rest = total - sum(round(tokens) for tokens, _ in named[:top])
        return {
            "window_s": self.seconds,
            "total_tokens": round(total),
            "tenants": shown,
            "others": {
                "tenants": len(totals) - len(shown),
                "tokens": round(max(rest, 0.0)),
                "share": max(rest, 0.0) / total if total else 0.0,
            },
        }


class VirtualTokenCounters:
    """One counter per tenant, the tenants active in the scheduler, and this step's expected charges.

    `enter` / `leave` follow each sequence into and out of the scheduler (waiting or running; a
    preempted sequence stays in). `pending` holds the charges of what this step has scheduled so far,
    so several admissions in one step spread over tenants instead of all going to the one that was
    behind when the step began.
    """

    def __init__(self, window: ServiceWindow | None = None):
        self.counters: dict[Hashable, float] = {}
        self.active: dict[Hashable, int] = {}  # tenant -> its sequences in the scheduler
        self.members: set[Request] = set()
        self.pending: dict[Hashable, float] = {}
        self.last_left = 0.0  # the counter of the tenant that went idle last: the floor when no one is active
        self.window = window or ServiceWindow()

    def value(self, tenant: Hashable) -> float:
        return self.counters.get(tenant, 0.0) + self.pending.get(tenant, 0.0)

    def enter(self, request: Request) -> None:
        tenant = request.tenant_key
        if self.active.get(tenant, 0) == 0:
            self._lift(tenant)
        self.active[tenant] = self.active.get(tenant, 0) + 1
        self.members.add(request)

    def _lift(self, tenant: Hashable) -> None:
        """Re-activation: never below the smallest counter of the active tenants (no credit banked while idle)."""
        floor = min((self.counters[t] for t in self.active), default=self.last_left)
        self.counters[tenant] = max(self.counters.get(tenant, 0.0), floor)

    def leave(self, request: Request) -> None:
        if request not in self.members:
            return  # never entered (a request held for its grammar, aborted or failed before scheduling)
        self.members.discard(request)
        tenant = request.tenant_key
        self.active[tenant] -= 1
        if self.active[tenant]:
            return
        del self.active[tenant]
        self.last_left = self.counters[tenant]
        floor = min((self.counters[t] for t in self.active), default=self.last_left)
        if request.tenant is None or self.counters[tenant] <= floor:
            del self.counters[tenant]  # it would be lifted to the floor anyway on its return

    def begin_step(self) -> None:
        self.pending.clear()

    def reserve(self, request: Request, num_new: int) -> None:
        """This step scheduled num_new tokens of request: count what they will be charged for ordering."""
        cost = PROMPT_TOKEN_COST * new_prompt_tokens(request, num_new)
        if request.num_computed_tokens + num_new == request.num_tokens:
            cost += OUTPUT_TOKEN_COST * request.n if request.needs_fork else OUTPUT_TOKEN_COST
        tenant = request.tenant_key
        self.pending[tenant] = self.pending.get(tenant, 0.0) + cost / request.weight

    def charge(self, request: Request, prompt_tokens: int = 0, output_tokens: int = 0) -> None:
        service = PROMPT_TOKEN_COST * prompt_tokens + OUTPUT_TOKEN_COST * output_tokens
        if not service:
            return
        tenant = request.tenant_key
        self.counters[tenant] = self.counters.get(tenant, 0.0) + service / request.weight
        self.window.add(request.tenant, service, request.weight)
