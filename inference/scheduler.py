"""Continuous batching with chunked prefill and priority-aware recompute preemption.

There are no prefill and decode phases: every running request has num_computed_tokens and
catches up to num_tokens under the step's token budget (vLLM v1). A long prompt is therefore
prefilled in chunks across steps while decodes keep producing a token every step.
"""
from __future__ import annotations

import heapq
import time
from dataclasses import dataclass, field

from inference.kv_cache_manager import KVCacheManager
from inference.request import Request, RequestStatus


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int = 2048
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int | None = None


@dataclass
class SchedulerOutput:
    scheduled: dict[Request, int] = field(default_factory=dict)  # request -> new tokens, batch order
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    finished: list[Request] = field(default_factory=list)  # ended by the scheduler (never fits)
    budget: int = 0  # tokens still free in this step while scheduling

    @property
    def num_tokens(self) -> int:
        return sum(self.scheduled.values())

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager):
        self.config = config
        self.kv = kv
        self.waiting: list[tuple[tuple[int, int], Request]] = []  # heap by (priority, arrival)
        self.running: list[Request] = []
        self.num_preemptions = 0

    def add_request(self, request: Request) -> None:
        request.status = RequestStatus.WAITING
        heapq.heappush(self.waiting, (request.sort_key, request))

    def add_running(self, request: Request) -> None:
        """A forked sequence joins the running set directly (it shares its parent's blocks)."""
        request.status = RequestStatus.RUNNING
        self.running.append(request)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, request: Request, status: RequestStatus) -> None:
        """Take a request out of the queues and free its blocks at once."""
        request.status = status
        request.metrics.finished_time = time.time()
        if request in self.running:
            self.running.remove(request)
        else:
            self._remove_waiting(request)
        self.kv.free(request)

    def _remove_waiting(self, request: Request) -> None:
        kept = [item for item in self.waiting if item[1] is not request]
        if len(kept) != len(self.waiting):
            self.waiting = kept
            heapq.heapify(self.waiting)

    def schedule(self) -> SchedulerOutput:
        """One step's batch. Running decodes go first (one token each keeps every stream moving);
        then prefill chunks of running requests and admissions of waiting ones share what is left
        of the budget in priority order, so an urgent arrival is never starved by the chunks of
        a long low-priority prompt."""
        out = SchedulerOutput(budget=self.config.max_num_batched_tokens)
        running = sorted(self.running, key=lambda r: r.sort_key)
        prefilling = [r for r in running if r.num_tokens - r.num_computed_tokens > 1]
        for request in running:
            if request.num_tokens - request.num_computed_tokens == 1:
                self._schedule_running(request, out)
        admitting = True
        for request in prefilling:
            while admitting and self.waiting and self.waiting[0][0] < request.sort_key and out.budget > 0:
                admitting = self._admit_one(out)
            self._schedule_running(request, out)
        while admitting and self.waiting and out.budget > 0:
            admitting = self._admit_one(out)
        out.block_copies = self.kv.take_copies()
        return out

    def _schedule_running(self, request: Request, out: SchedulerOutput) -> None:
        if out.budget <= 0 or request.status is not RequestStatus.RUNNING:
            return  # out of budget, or preempted earlier in this step
        num_new = self._chunk(request, request.num_tokens - request.num_computed_tokens, out.budget)
        if num_new > 0 and self._allocate_running(request, num_new, out):
            out.scheduled[request] = num_new
            out.budget -= num_new

    def _chunk(self, request: Request, num_new: int, budget: int) -> int:
        cap = self.config.long_prefill_token_threshold
        if cap and num_new > 1:
            num_new = min(num_new, cap)
        return min(num_new, budget)

    def _allocate_running(self, request: Request, num_new: int, out: SchedulerOutput) -> bool:
        """Allocate for a running request, preempting the worst running request while short."""
        while not self.kv.allocate_slots(request, num_new):
            victim = max((r for r in self.running), key=lambda r: r.sort_key)
            if victim is request and self._can_never_fit(request, num_new):
                self.finish(request, RequestStatus.FINISHED_LENGTH)
                out.finished.append(request)
                return False
            self._preempt(victim, out)
            if victim is request:
                return False
        return True

    def _can_never_fit(self, request: Request, num_new: int) -> bool:
        needed = self.kv.blocks_needed(request.num_computed_tokens + num_new)
        return needed > self.kv.pool.num_blocks or len(self.running) == 1

    def _preempt(self, victim: Request, out: SchedulerOutput) -> None:
        """Recompute preemption: free the blocks (cached ones stay reusable), back to waiting."""
        out.scheduled.pop(victim, None)  # if it was already scheduled, its budget is not handed back
        self.running.remove(victim)
        self.kv.free(victim)
        victim.num_computed_tokens = 0
        victim.status = RequestStatus.PREEMPTED
        victim.metrics.num_preemptions += 1
        self.num_preemptions += 1
        out.preempted.append(victim)
        heapq.heappush(self.waiting, (victim.sort_key, victim))

    def _admit_one(self, out: SchedulerOutput) -> bool:
        """Try to start the head of the waiting queue; False means stop admitting this step."""
        request = self.waiting[0][1]
        if request in out.preempted:
            return False  # no thrashing: a request preempted in this step waits for the next
        if len(self.running) >= self.config.max_num_seqs and not self._preempt_lower(request, out):
            return False
        computed, num_cached = self.kv.get_computed_blocks(request)
        num_new = request.num_tokens - num_cached
        if not self.config.enable_chunked_prefill and num_new > out.budget:
            return False
        num_new = self._chunk(request, num_new, out.budget)
        if not self.kv.allocate_slots(request, num_new, computed):
            if self.kv.blocks_needed(request.num_tokens) > self.kv.pool.num_blocks:
                # longer than the whole pool: it can never run, and waiting would block the queue
                self.finish(request, RequestStatus.FINISHED_LENGTH)
                out.finished.append(request)
                return True
            return self._preempt_lower(request, out)  # True: retry with the freed blocks
        heapq.heappop(self.waiting)
        self._start(request, num_cached)
        out.scheduled[request] = num_new
        out.budget -= num_new
        return True

    def _start(self, request: Request, num_cached: int) -> None:
        if request.metrics.first_scheduled_time is None:
            request.metrics.first_scheduled_time = time.time()
            request.num_cached_tokens = num_cached
            self.kv.record_prefix_query(request.num_prompt_tokens, num_cached)
        request.num_computed_tokens = num_cached
        request.status = RequestStatus.RUNNING
        self.running.append(request)

    def _preempt_lower(self, request: Request, out: SchedulerOutput) -> bool:
        """A higher-priority arrival preempts the worst running request of strictly lower priority."""
        candidates = [r for r in self.running if r.priority > request.priority]
        if not candidates:
            return False
        self._preempt(max(candidates, key=lambda r: r.sort_key), out)
        return True
