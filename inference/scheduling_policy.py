"""The scheduler's orders (engine argument `scheduling_policy`) and its waiting queue.

- `fcfs`: arrival order only (the request's priority is ignored, and nothing preempts for priority).
- `priority`: lower priority value first, then arrival; a waiting request may preempt running ones of
  strictly lower priority.
- `fair`: priority stays the outer key; within a priority level the tenant with the smallest virtual
  token counter (fairness.py) goes first, then arrival. The preemption victim is therefore the latest
  request of the tenant furthest ahead in the lowest priority. When the batch is full, a waiting request
  may also take a seat from a tenant holding at least two more seats than its own, if its tenant is
  ahead of that tenant and of the head's by less than this request's own prompt charge (`seat_slack`),
  so a newcomer, or an interactive user's next request while its last still streams, gets the next
  step, not the next seat that frees.

One `key` orders everything the scheduler compares: the waiting heads, running requests (whose
chunks go first) and, by its maximum, the preemption victim.
"""

from __future__ import annotations

import heapq
from collections.abc import Hashable, Iterator, Mapping

from inference.fairness import VirtualTokenCounters, seat_slack
from inference.request import Request

POLICIES = ("fcfs", "priority", "fair")


class SchedulingPolicy:
    name = "priority"

    def __init__(self, counters: VirtualTokenCounters):
        self.counters = counters

    def queue_of(self, request: Request) -> Hashable:
        """Which waiting heap a request joins (its head is compared with the other heaps' heads)."""
        return None

    def static_key(self, request: Request) -> tuple:
        """Order inside one waiting heap: fixed while the request waits."""
        return request.sort_key

    def key(self, request: Request) -> tuple:
        return self.static_key(request)

    def outranks(self, request: Request, running: Request, seats: Mapping[Hashable, int]) -> bool:
        """May a waiting request preempt this running one to get in? seats: running requests per tenant."""
        return request.priority < running.priority

    def may_pass(self, request: Request, head: Request, seats: Mapping[Hashable, int], most_seats: int) -> bool:
        """May a waiting request other than the head take a seat in a full batch where the head could not?
        most_seats: the most seats one tenant holds."""
        return False


class FcfsPolicy(SchedulingPolicy):
    name = "fcfs"

    def static_key(self, request: Request) -> tuple:
        return (request.arrival_order, request.index)

    def outranks(self, request: Request, running: Request, seats: Mapping[Hashable, int]) -> bool:
        return False


class FairPolicy(SchedulingPolicy):
    name = "fair"

    def queue_of(self, request: Request) -> Hashable:
        return request.tenant_key

    def key(self, request: Request) -> tuple:
        return (request.priority, self.counters.value(request.tenant_key), request.arrival_order, request.index)

    def outranks(self, request: Request, running: Request, seats: Mapping[Hashable, int]) -> bool:
        if request.priority != running.priority:
            return request.priority < running.priority
        # A seat moves only from a tenant holding at least two more: every move narrows the gap, so seats
        # even out and never swing back (no thrashing), and nobody loses its last seat.
        tenant, other = request.tenant_key, running.tenant_key
        return seats.get(tenant, 0) + 2 <= seats.get(other, 0) and self.within_slack(request, other)

    def may_pass(self, request: Request, head: Request, seats: Mapping[Hashable, int], most_seats: int) -> bool:
        # the head's tenant has the smallest counter of the backlogged ones at its priority; the seat count is
        # outranks' condition, checked first because it is cheap and rules out most tenants in a crowd
        return (
            request.priority == head.priority
            and seats.get(request.tenant_key, 0) + 2 <= most_seats
            and self.within_slack(request, head.tenant_key)
        )

    def within_slack(self, request: Request, other: Hashable) -> bool:
        """Is request's tenant ahead of the other tenant by less than request's own prompt charge?"""
        return self.counters.value(request.tenant_key) - self.counters.value(other) < seat_slack(request)


def make_policy(name: str, counters: VirtualTokenCounters) -> SchedulingPolicy:
    policies = {cls.name: cls for cls in (FcfsPolicy, SchedulingPolicy, FairPolicy)}
    if name not in policies:
        raise ValueError(f"scheduling_policy must be one of {', '.join(POLICIES)}; got {name!r}")
    return policies[name](counters)


class WaitingQueue:
    """Waiting requests in one heap per `policy.queue_of` (one per tenant under `fair`); the head is the
    best of the heaps' heads by `policy.key`. Iterating yields (static key, request) pairs."""

    def __init__(self, policy: SchedulingPolicy):
        self.policy = policy
        self.heaps: dict[Hashable, list[tuple[tuple, Request]]] = {}
        self.size = 0

    def push(self, request: Request) -> None:
        heap = self.heaps.setdefault(self.policy.queue_of(request), [])
        heapq.heappush(heap, (self.policy.static_key(request), request))
        self.size += 1

    def head(self) -> Request:
        if len(self.heaps) == 1:
            return next(iter(self.heaps.values()))[0][1]
        return min(self.heads(), key=self.policy.key)

    def heads(self) -> Iterator[Request]:
        """Each heap's head (one per tenant under fair), in no particular order."""
        return (heap[0][1] for heap in self.heaps.values())

    def remove(self, request: Request) -> bool:
        """Take request out (the head's removal is a heap pop); False if it was not waiting."""
        queue = self.policy.queue_of(request)
        heap = self.heaps.get(queue, [])
        if heap and heap[0][1] is request:
            heapq.heappop(heap)
        else:
            kept = [item for item in heap if item[1] is not request]
            if len(kept) == len(heap):
                return False
            heapq.heapify(kept)
            self.heaps[queue] = heap = kept
        self.size -= 1
        if not heap:
            del self.heaps[queue]
        return True

    def __len__(self) -> int:
        return self.size

    def __iter__(self) -> Iterator[tuple[tuple, Request]]:
        for heap in self.heaps.values():
            yield from heap

    def __repr__(self) -> str:
        return f"WaitingQueue({[request for _, request in self]})"
