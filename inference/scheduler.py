"""Continuous batching with chunked prefill and priority-aware recompute preemption, in the order of
the engine's scheduling policy (scheduling_policy.py: fcfs, priority, or fair share between tenants).

There are no prefill and decode phases: every running request has num_computed_tokens and
catches up to num_tokens under the step's token budget (vLLM v1). A long prompt is therefore
prefilled in chunks across steps while decodes keep producing a token every step.

After the forward, `update_from_output` applies the step's results (vLLM's name): it advances
num_computed_tokens, caches newly full blocks, registers n > 1 forks, appends the sampled tokens
and finishes stopped sequences. One request's failure (`fail`) ends that request alone.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import cast

from inference.fairness import VirtualTokenCounters, new_prompt_tokens
from inference.kv_cache_manager import KVCacheManager
from inference.metrics import EngineMetrics
from inference.outputs import Logprob
from inference.request import Request, RequestStatus
from inference.sampling_params import SamplingParams
from inference.scheduling_policy import WaitingQueue, make_policy

logger = logging.getLogger("inference")


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int = 2048
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    scheduling_policy: str = "priority"  # "fcfs", "priority" or "fair" (scheduling_policy.py)


@dataclass
class SchedulerOutput:
    scheduled: dict[Request, int] = field(default_factory=dict)  # request -> new tokens, batch order
    block_tables: dict[Request, list[int]] = field(default_factory=dict)  # block ids of each scheduled request
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    finished: list[Request] = field(default_factory=list)  # ended by the scheduler (never fits, or failed)
    # speculative decoding: the proposed tokens each speculating decode verifies this step (counted in scheduled)
    spec_tokens: dict[Request, list[int]] = field(default_factory=dict)
    budget: int = 0  # tokens still free in this step while scheduling

    @property
    def num_tokens(self) -> int:
        return sum(self.scheduled.values())

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass
class SampledToken:
    """One sequence's token of this step, with what the engine made of it before the stop checks."""

    seq: Request
    token: int
    logprobs: dict[int, Logprob] | None = None
    stop_string: str | None = None  # a stop string the detokenizer found in the new text


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager, metrics: EngineMetrics | None = None):
        self.config = config
        self.kv = kv
        self.metrics = metrics or EngineMetrics()
        self.counters = VirtualTokenCounters()  # charged under every policy: the share panel shows them all
        self.policy = make_policy(config.scheduling_policy, self.counters)
        self.waiting = WaitingQueue(self.policy)
        self.running: list[Request] = []
        self.num_preemptions = 0

    def add_request(self, request: Request) -> None:
        request.status = RequestStatus.WAITING
        self.counters.enter(request)
        self.waiting.push(request)

    def add_running(self, request: Request) -> None:
        """A forked sequence joins the running set directly (it shares its parent's blocks)."""
        request.status = RequestStatus.RUNNING
        self.counters.enter(request)
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
            self.waiting.remove(request)
        self.counters.leave(request)
        self.kv.free(request)

    def schedule(self) -> SchedulerOutput:
        """One step's batch. Running decodes go first (one token each keeps every stream moving);
        then prefill chunks of running requests and admissions of waiting ones share what is left
        of the budget in priority order, so an urgent arrival is never starved by the chunks of
        a long low-priority prompt."""
        out = SchedulerOutput(budget=self.config.max_num_batched_tokens)
        self.counters.begin_step()
        running = sorted(self.running, key=self.policy.key)
        prefilling = [r for r in running if r.num_tokens - r.num_computed_tokens > 1]
        for request in running:
            if request.num_tokens - request.num_computed_tokens == 1:
                self._schedule_running(request, out)
        admitting = True
        for request in prefilling:
            while admitting and self._waiting_goes_before(request) and out.budget > 0:
                admitting = self._admit_one(out)
            self._schedule_running(request, out)
        while admitting and self.waiting and out.budget > 0:
            admitting = self._admit_one(out)
        out.block_copies = self.kv.take_copies()
        out.block_tables = {request: self.kv.block_ids(request) for request in out.scheduled}
        out.spec_tokens = {r: drafts for r, drafts in out.spec_tokens.items() if r in out.scheduled}  # not preempted
        return out

    def _waiting_goes_before(self, request: Request) -> bool:
        return bool(self.waiting) and self.policy.key(self.waiting.head()) < self.policy.key(request)

    def _schedule_running(self, request: Request, out: SchedulerOutput) -> None:
        if out.budget <= 0 or request.status is not RequestStatus.RUNNING:
            return  # out of budget, or preempted earlier in this step
        num_new = self._chunk(request, request.num_tokens - request.num_computed_tokens, out.budget)
        drafts = self._drafts_that_fit(request, num_new, out)
        if drafts:
            out.spec_tokens[request] = drafts
            self._scheduled(request, num_new + len(drafts), out)
        elif num_new > 0 and self._allocate_running(request, num_new, out):
            self._scheduled(request, num_new, out)

    def _drafts_that_fit(self, request: Request, num_new: int, out: SchedulerOutput) -> list[int]:
        """A decode's proposed tokens (speculative decoding) that the budget, max_model_len and the free
        blocks have room for, their slots allocated; speculation never preempts anyone."""
        drafts = request.spec_token_ids
        if not drafts or num_new != 1 or request.num_tokens - request.num_computed_tokens != 1:
            return []
        drafts = drafts[: max(0, min(out.budget - 1, self.config.max_model_len - request.num_tokens - 1))]
        if not drafts or not self.kv.allocate_slots(request, 1 + len(drafts)):
            return []
        return drafts

    def _scheduled(self, request: Request, num_new: int, out: SchedulerOutput) -> None:
        out.scheduled[request] = num_new
        out.budget -= num_new
        self.counters.reserve(request, num_new)

    def _chunk(self, request: Request, num_new: int, budget: int) -> int:
        cap = self.config.long_prefill_token_threshold
        if cap and num_new > 1:
            num_new = min(num_new, cap)
        return min(num_new, budget)

    def _allocate_running(self, request: Request, num_new: int, out: SchedulerOutput) -> bool:
        """Allocate for a running request, preempting the worst running request while short."""
        while not self.kv.allocate_slots(request, num_new):
            victim = max(self.running, key=self.policy.key)
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
        self.waiting.push(victim)  # still its tenant's: no re-activation, and its early arrival puts it first

    def _admit_one(self, out: SchedulerOutput) -> bool:
        """Try to start the head of the waiting queue; False means stop admitting this step."""
        head = self.waiting.head()
        if head in out.preempted:
            return False  # no thrashing: a request preempted in this step waits for the next
        request: Request | None = head
        if len(self.running) >= self.config.max_num_seqs:
            request = self._take_seat(head, out)
        if request is None:
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
        self.waiting.remove(request)
        self._start(request, num_cached)
        self._scheduled(request, num_new, out)
        return True

    def _start(self, request: Request, num_cached: int) -> None:
        if request.metrics.first_scheduled_time is None:
            request.metrics.first_scheduled_time = time.time()
            request.num_cached_tokens = num_cached
            self.kv.record_prefix_query(request.num_prompt_tokens, num_cached)
        request.num_computed_tokens = num_cached
        request.status = RequestStatus.RUNNING
        self.running.append(request)

    def _take_seat(self, head: Request, out: SchedulerOutput) -> Request | None:
        """A full batch: the head, or else the best waiting request the policy lets pass it, preempts a
        running request it outranks; returns which of them got the seat."""
        seats: Counter[Hashable] = Counter(r.tenant_key for r in self.running)
        most = max(seats.values(), default=0)
        others = [r for r in self.waiting.heads() if r is not head and r not in out.preempted]
        passing = sorted((r for r in others if self.policy.may_pass(r, head, seats, most)), key=self.policy.key)
        for request in [head, *passing]:
            if self._preempt_lower(request, out, seats):
                return request
        return None

    def _preempt_lower(self, request: Request, out: SchedulerOutput, seats: Counter[Hashable] | None = None) -> bool:
        """A waiting request preempts the worst running request it outranks (policy.outranks)."""
        seats = seats or Counter(r.tenant_key for r in self.running)
        candidates = [r for r in self.running if self.policy.outranks(request, r, seats)]
        if not candidates:
            return False
        self._preempt(max(candidates, key=self.policy.key), out)
        return True

    # ---- after the forward ---------------------------------------------------------------------

    def update_from_output(self, out: SchedulerOutput, sampled: list[SampledToken]) -> list[Request]:
        """Apply one step's results; returns the sequences that got a token.

        Every scheduled request advances by its new tokens (and caches its full blocks); forks
        spawned for this step's samples join their parent's blocks before any token is appended
        (a parent that stops now must not free blocks its children still need); then each
        sequence gets its token and the stop checks. An exception there fails that request alone.
        A speculating sequence gets its accepted tokens in order (a stop ends it there) and only then
        advances, over the positions whose K/V it keeps; the blocks only rejected proposals used go back.
        """
        for request, num_new in out.scheduled.items():
            if not request.is_finished and request not in out.spec_tokens:
                self._advance(request, num_new)
        for item in sampled:
            if item.seq.status is RequestStatus.WAITING:  # spawned by Request.fork for this sample
                self._join_parent(item.seq)
        now = time.time()
        updated = []
        for item in sampled:
            if item.seq.is_finished:  # its request failed earlier in this step
                continue
            try:
                self._append(item, now)
            except Exception as exc:
                self.fail(item.seq, "stop checks", exc, out)
            updated.append(item.seq)
        for request in out.spec_tokens:
            if not request.is_finished:
                self._advance(request, request.num_tokens - 1 - request.num_computed_tokens)
                self.kv.trim(request, request.num_tokens)
        return updated

    def ends_at(self, seq: Request, token: int, num_output_tokens: int) -> bool:
        """Whether token, as seq's num_output_tokens-th output token, ends it by a token rule (a stop
        token, EOS, max_tokens, max_model_len): where a speculating sequence's accepted tokens are cut."""
        params = seq.params
        if num_output_tokens >= params.min_tokens and (
            token in stop_ids(params) or (not params.ignore_eos and token in self.config.eos_token_ids)
        ):
            return True
        if params.max_tokens is not None and num_output_tokens >= params.max_tokens:
            return True
        return seq.num_prompt_tokens + num_output_tokens >= self.config.max_model_len

    def fail(self, request: Request, stage: str, exc: BaseException, out: SchedulerOutput) -> None:
        """End every sequence of request's group with an error naming stage and cause; free its blocks.

        An error marked fatal (a dead tensor-parallel rank) is no one request's fault: it propagates.
        """
        if getattr(exc, "fatal", False):
            raise exc
        root = request.root
        if root.error is not None:
            return
        logger.error("request %s failed in %s", request.request_id, stage, exc_info=exc)
        root.error = f"{stage} failed: {type(exc).__name__}: {exc}"
        for seq in root.group:
            if not seq.is_finished:
                self.finish(seq, RequestStatus.FINISHED_ERROR)
        out.finished.append(root)

    def _advance(self, request: Request, num_new: int) -> None:
        prompt_left = max(0, request.num_prompt_tokens - request.num_computed_tokens)
        self.metrics.prompt_tokens_total += min(num_new, prompt_left)
        served = new_prompt_tokens(request, num_new)
        self.counters.charge(request, prompt_tokens=served)
        request.served_prompt_tokens += served
        request.num_computed_tokens += num_new
        self.kv.cache_full_blocks(request)

    def _join_parent(self, child: Request) -> None:
        """An n > 1 fork: the child shares every block of its parent (copy on write later)."""
        parent = child.root
        child.num_computed_tokens = parent.num_computed_tokens
        self.kv.fork(parent, child)
        self.add_running(child)

    def _append(self, item: SampledToken, now: float) -> None:
        seq, token = item.seq, item.token
        if seq.matcher is not None and not seq.matcher.is_terminated() and not seq.matcher.accept_token(token):
            raise ValueError(f"token {token} breaks the request's structured_outputs grammar")
        seq.append_token(token)
        self.metrics.generation_tokens_total += 1
        self.counters.charge(seq, output_tokens=1)
        if seq.metrics.first_token_time is None:
            self._observe_first_token(seq, now)
        if item.logprobs is not None:
            assert seq.logprobs is not None  # logprobs come only for requests that asked
            seq.logprobs.append(item.logprobs)
            seq.cumulative_logprob += item.logprobs[token].logprob
        status = self._stop_status(seq, token, item.stop_string)
        if status is not None:
            self.finish(seq, status)
            self.metrics.observe_finished(seq.metrics, seq.num_output_tokens, status.value)

    def _observe_first_token(self, seq: Request, now: float) -> None:
        seq.metrics.first_token_time = now
        if seq.index == 0:
            self.metrics.time_to_first_token_seconds.observe(now - seq.metrics.arrival_time)
            if seq.metrics.queue_time is not None:
                self.metrics.request_queue_time_seconds.observe(seq.metrics.queue_time)

    def _stop_status(self, seq: Request, token: int, stop_string: str | None) -> RequestStatus | None:
        params = seq.params
        if seq.matcher is not None and seq.matcher.is_terminated():
            # the grammar ended on an end-of-turn token: the answer is complete (min_tokens and
            # ignore_eos cannot hold a finished structure open; the sampler lets it end)
            return RequestStatus.FINISHED_STOPPED
        may_stop = seq.num_output_tokens >= params.min_tokens
        if may_stop and token in stop_ids(params):
            seq.stop_reason = token
            return RequestStatus.FINISHED_STOPPED
        if may_stop and not params.ignore_eos and token in self.config.eos_token_ids:
            return RequestStatus.FINISHED_STOPPED
        if may_stop and stop_string is not None:
            seq.stop_reason = stop_string
            return RequestStatus.FINISHED_STOPPED
        if params.max_tokens is not None and seq.num_output_tokens >= params.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        if seq.num_tokens >= self.config.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None


def stop_ids(params: SamplingParams) -> list[int]:
    """params.stop_token_ids, a list once SamplingParams is built (None only in the constructor's signature)."""
    return cast(list[int], params.stop_token_ids)
