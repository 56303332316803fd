"""Speculative decoding's policy: which running sequences speculate this step, and how far.

A step's proposals (Request.spec_token_ids, cut to what a structured-output request's grammar accepts)
are made before the scheduler runs; it schedules a speculating decode as a query of 1 + k tokens, the
target verifies them (RejectionSampler, each row processed as a plain step would process its position)
and the scheduler keeps the accepted ones. Every request speculates unless it opted out.

k adapts per sequence and step. With an acceptance probability a per proposal, k proposals yield
E(k) = 1 + a + ... + a^k tokens for a step of B * (1 + k) tokens plus k proposed tokens, where plain
decoding at batch size B gets 1 token for a step of B tokens. What those steps cost is measured as
the engine runs (StepCosts); until a size is measured a model stands in (a step of T tokens costs
1 + COST_PER_TOKEN * (T - 1) of a one-token step: on CPU a decode step reads every weight once, so extra
rows are cheap at small B). k is the one with the best speed-up, and 0 (plain decoding) when no k
beats 1: a busy engine, or a proposer that costs more than it saves, runs at plain-decoding speed. The
acceptance rate is measured per sequence (decayed, so it follows the text), from a prior: 0.5 where
proposals are free; where they cost (a draft model), what the engine's recent verifications measured,
and 1.0 before the first, so that the draft is tried and measured at all. A sequence at k = 0 drifts back
to its prior and tries again later.

A draft model must first catch up on what it has not seen of a sequence (its prompt, or the steps it ran
plain): C plain steps, paid once. Over the R tokens the sequence may still produce, speculating at speed-up
s beats plain decoding only when R / s + C < R, so the speed-up it needs rises to R / (R - C) until then.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from inference.metrics import EngineMetrics
from inference.request import Request
from inference.sampler import Sampler
from inference.spec_decode.config import SpeculativeConfig
from inference.spec_decode.rejection_sampler import RejectionSampler
from inference.structured_output import grammar_prefix

PRIOR_ACCEPTANCE = 0.5  # a sequence's acceptance before its first verification where proposals are free (n-gram)
# Where proposals cost (a draft model) a sequence starts from what the engine's recent verifications
# measured, and before the first from this: optimistic, or a draft that never proposed is never found to pay
UNMEASURED_ACCEPTANCE = 1.0
PRIOR_WEIGHT = 2.0  # how many verified proposals the prior is worth
DECAY = 0.8  # weight of older verifications at each new one (and at each step without proposals)
COST_PER_TOKEN = 0.02  # extra cost of one more token in a step, relative to a one-token step (CPU; docs/benchmarks.md)
MIN_SPEEDUP = 1.02  # below this expected gain a step runs plain (proposing and verifying cost something too)
CATCH_UP_SHARE = 0.15  # a caught-up token's cost against a proposed one: a prefill row, not a decode step (CPU)
MEASURED_WEIGHT = 0.25  # of a newest timing slower than a size's moving average
FASTER_WEIGHT = 0.5  # of one faster: a cold first step is forgotten within a few
STALE_AFTER = 256  # steps after which a size's timing is measured afresh, so a k once found dear is retried


class Proposer(Protocol):
    # What proposing one token costs, relative to one plain decode step of the target: 0 for a lookup,
    # a draft model's share of the target's weight bytes (a batch-1 step on CPU reads every weight once).
    cost_per_token: float

    def propose(self, seqs: list[Request], ks: list[int]) -> Sequence[list[int] | BaseException]:
        """Up to ks[i] proposed next tokens for each sequence (fewer, or none, where it has no guess),
        or the exception that sequence's proposal failed with (it fails that request alone)."""

    def catch_up_tokens(self, seq: Request) -> int:
        """Tokens of seq the proposer must process before it proposes, beyond what one round's proposal
        takes anyway: 0 for a lookup, a draft model's backlog (a prompt it has not seen, steps run plain)."""


@dataclass
class Acceptance:
    accepted: float = 0.0
    rejected: float = 0.0
    prior: float = PRIOR_ACCEPTANCE

    @property
    def rate(self) -> float:
        return (self.accepted + self.prior * PRIOR_WEIGHT) / (self.accepted + self.rejected + PRIOR_WEIGHT)

    def observe(self, num_drafts: int, num_accepted: int) -> None:
        self.decay()
        self.accepted += num_accepted
        self.rejected += num_accepted < num_drafts

    def decay(self) -> None:
        self.accepted *= DECAY
        self.rejected *= DECAY


def expected_speedup(k: int, acceptance: float, batch_size: int, costs: StepCosts) -> float:
    """Tokens per step over the step's cost, both against plain decoding at this batch size."""
    tokens = sum(acceptance**j for j in range(k + 1))
    return tokens / (costs.step(batch_size * (1 + k), batch_size) + k * costs.proposal(batch_size))


def step_cost(num_tokens: int) -> float:
    """The model: a step of num_tokens in one-token steps."""
    return 1.0 + COST_PER_TOKEN * (num_tokens - 1)


def best_k(max_k: int, acceptance: float, batch_size: int, costs: StepCosts, min_speedup: float = MIN_SPEEDUP) -> int:
    best, best_gain = 0, min_speedup
    for k in range(1, max_k + 1):
        gain = expected_speedup(k, acceptance, batch_size, costs)
        if gain > best_gain:
            best, best_gain = k, gain
    return best


@dataclass
class Timing:
    seconds: float
    at: int  # StepCosts.clock when last measured


class StepCosts:
    """What speculation's k weighs, measured on this machine: the target's step seconds by the tokens in
    the step, the proposer's seconds per proposed token by batch size, and per caught-up token (moving
    averages that fall faster than they rise; a new timing counts at most twice the average, so one stall
    does not swing it).

    `step(T, B)` is a T-token step's cost in plain steps of batch B, `proposal(B)` one proposed token's,
    `catch_up(B)` one caught-up token's. A step's time grows about linearly with its tokens, so step(T, B)
    follows the least-squares line from B's plain timing through the fresh timings of the sizes B's
    speculation can reach (B + 1 .. B * (1 + max_k)): every verification step prices every size, one
    stalled step moves the line a little, and a size not yet seen costs what its neighbours say. Without
    those timings the model stands in (step_cost, the proposer's own cost_per_token, CATCH_UP_SHARE of it):
    k starts from the model and follows the machine once it has timings. A configured draft_cost is the
    proposal's cost as given, never measured.
    """

    def __init__(self, proposal_cost: float, measure_proposals: bool = True, max_k: int = 32):
        self.model_proposal_cost = proposal_cost
        self.measure_proposals = measure_proposals  # False: proposal_cost was configured, and is used as given
        self.max_k = max_k
        self.steps: dict[int, Timing] = {}
        self.proposals: dict[int, Timing] = {}
        self.catch_ups: dict[int, Timing] = {}  # seconds per caught-up token, under key 1 (any batch size)
        self.clock = 0  # steps observed
        self.slopes: dict[int, float | None] = {}  # batch size -> its line's slope, until the next step's timing

    def observe_step(self, num_tokens: int, seconds: float) -> None:
        self.clock += 1
        self._observe(self.steps, num_tokens, seconds)
        self.slopes.clear()

    def observe_proposal(self, batch_size: int, num_tokens: int, seconds: float) -> None:
        """num_tokens proposed tokens per sequence (the draft's forwards) took seconds for this batch."""
        if num_tokens and self.measure_proposals:
            self._observe(self.proposals, batch_size, seconds / num_tokens)

    def observe_catch_up(self, num_tokens: int, seconds: float) -> None:
        """A proposal call that caught up on num_tokens took seconds (its proposals included: an upper bound)."""
        if num_tokens and self.measure_proposals:
            self._observe(self.catch_ups, 1, seconds / num_tokens)

    def needs_plain_timing(self, batch_size: int) -> bool:
        """No fresh timing of a plain step at this batch size: every speed-up is measured against one."""
        return self._seconds(self.steps, batch_size) is None

    def step(self, num_tokens: int, batch_size: int) -> float:
        plain = self._seconds(self.steps, batch_size)
        slope = None if plain is None else self._seconds_per_extra_token(batch_size, plain)
        if plain is None or slope is None:
            return step_cost(num_tokens) / step_cost(batch_size)
        return 1.0 + slope * (num_tokens - batch_size) / plain

    def _seconds_per_extra_token(self, batch_size: int, plain: float) -> float | None:
        """The slope of the least-squares line through (batch_size, plain) and the larger sizes' timings, fitted
        once per batch size between step timings (every sequence's every k asks for it)."""
        if batch_size not in self.slopes:
            self.slopes[batch_size] = self._fitted_slope(batch_size, plain)
        return self.slopes[batch_size]

    def _fitted_slope(self, batch_size: int, plain: float) -> float | None:
        points = [
            (size - batch_size, seconds - plain)
            for size in self.steps
            if batch_size < size <= batch_size * (1 + self.max_k)
            and (seconds := self._seconds(self.steps, size)) is not None
        ]
        if not points:
            return None
        return max(0.0, sum(dx * dy for dx, dy in points) / sum(dx * dx for dx, _ in points))

    def proposal(self, batch_size: int) -> float:
        plain, token = self._seconds(self.steps, batch_size), self._seconds(self.proposals, batch_size)
        if plain is not None and token is not None:
            return token / plain
        return self.model_proposal_cost

    def catch_up(self, batch_size: int) -> float:
        plain, token = self._seconds(self.steps, batch_size), self._seconds(self.catch_ups, 1)
        if plain is not None and token is not None:
            return token / plain
        return self.model_proposal_cost * CATCH_UP_SHARE

    def required_speedup(self, catch_up_tokens: int, remaining: int, batch_size: int) -> float:
        """The speed-up that repays catching up on catch_up_tokens over the remaining tokens (inf: none can)."""
        cost = catch_up_tokens * self.catch_up(batch_size)
        if cost >= remaining:
            return float("inf")
        return max(MIN_SPEEDUP, remaining / (remaining - cost))

    def _observe(self, table: dict[int, Timing], size: int, seconds: float) -> None:
        timing = table.get(size)
        if timing is None or self.clock - timing.at > STALE_AFTER:
            table[size] = Timing(seconds, self.clock)
            return
        seconds = min(seconds, timing.seconds * 2)
        weight = FASTER_WEIGHT if seconds < timing.seconds else MEASURED_WEIGHT
        timing.seconds += weight * (seconds - timing.seconds)
        timing.at = self.clock

    def _seconds(self, table: dict[int, Timing], size: int) -> float | None:
        timing = table.get(size)
        return timing.seconds if timing is not None and self.clock - timing.at <= STALE_AFTER else None


class Speculator:
    def __init__(
        self,
        config: SpeculativeConfig,
        proposer: Proposer,
        sampler: Sampler,
        metrics: EngineMetrics,
        max_model_len: int,
        row_limit: int | None = None,
    ):
        self.config, self.proposer, self.metrics = config, proposer, metrics
        # a step's rows stay below it (the packed linears' crossover: quantization/gguf.row_invariant_rows),
        # so every verified token is scored with the bits plain decoding gives it
        self.row_limit = row_limit
        self.verify_rows = RejectionSampler(sampler)
        self.max_model_len = max_model_len
        self.acceptance: weakref.WeakKeyDictionary[Request, Acceptance] = weakref.WeakKeyDictionary()
        # every sequence's verifications, a new sequence's prior where proposing costs (None: it is free)
        self.measured = Acceptance(prior=UNMEASURED_ACCEPTANCE) if proposer.cost_per_token > 0 else None
        self.costs = StepCosts(
            proposer.cost_per_token, measure_proposals=config.draft_cost is None, max_k=config.num_speculative_tokens
        )

    def propose(self, running: list[Request]) -> list[tuple[Request, BaseException]]:
        """Set spec_token_ids of every running sequence (empty where it does not speculate this step);
        returns the sequences whose proposal failed, with the exception."""
        for seq in running:
            seq.spec_token_ids = []
        limit = self.config.disable_by_batch_size
        spare_rows = None if self.row_limit is None else self.row_limit - 1 - len(running)
        if (
            (limit is not None and len(running) > limit)
            or (spare_rows is not None and spare_rows <= 0)
            or self.costs.needs_plain_timing(len(running))
        ):
            return []
        seqs, ks, backlog = [], [], 0
        for seq in running:
            if not (self._is_decode(seq) and seq.params.speculative):  # a request may opt out
                continue
            catch_up = self.proposer.catch_up_tokens(seq)
            k = self._k_for(seq, len(running), catch_up)
            if spare_rows is not None:
                k = max(0, min(k, spare_rows))
                spare_rows -= k
            if k:
                seqs.append(seq)
                ks.append(k)
                backlog += catch_up
        if not seqs:
            if self.measured is not None:  # back towards optimism, or a draft once found poor is never retried
                self.measured.decay()
            return []
        start = time.perf_counter()
        proposals = self.proposer.propose(seqs, ks)
        seconds = time.perf_counter() - start
        if backlog:
            self.costs.observe_catch_up(backlog, seconds)
        else:
            self.costs.observe_proposal(len(running), max(ks), seconds)
        failed = []
        for seq, drafts in zip(seqs, proposals):
            if isinstance(drafts, BaseException):
                failed.append((seq, drafts))
            elif seq.matcher is not None:
                seq.spec_token_ids = grammar_prefix(seq.matcher, list(drafts))
                if len(seq.spec_token_ids) < len(drafts):  # a proposal the grammar refused is a rejection to k
                    self._observe(seq, 1, 0)
            else:
                seq.spec_token_ids = list(drafts)
        return failed

    @staticmethod
    def _is_decode(seq: Request) -> bool:
        return seq.num_tokens - seq.num_computed_tokens == 1

    def _k_for(self, seq: Request, batch_size: int, catch_up_tokens: int) -> int:
        params = seq.params
        room = self.max_model_len - seq.num_tokens - 1  # the bonus token needs a position too
        if params.max_tokens is not None:
            room = min(room, params.max_tokens - seq.num_output_tokens - 1)
        max_k = min(self.config.num_speculative_tokens, room)
        if max_k <= 0:
            return 0
        acceptance = self._acceptance(seq)
        needed = self.costs.required_speedup(catch_up_tokens, room + 1, batch_size)
        k = best_k(max_k, acceptance.rate, batch_size, self.costs, needed)
        if k == 0:
            acceptance.decay()  # back towards the prior: it tries again once that says it may pay
        return k

    def verify(self, logits, seq: Request, drafts: list[int]) -> tuple[list[int], list]:
        """The tokens seq keeps of this step (accepted proposals, then the target's own token) and their
        logprob entries; the outcome goes to the metrics and the sequence's acceptance rate."""
        tokens, entries = self.verify_rows(logits, seq, drafts)
        num_accepted = len(tokens) - 1
        self.metrics.observe_spec_decode(len(drafts), num_accepted)
        self._observe(seq, len(drafts), num_accepted)
        return tokens, entries

    def _acceptance(self, seq: Request) -> Acceptance:
        found = self.acceptance.get(seq)
        if found is None:
            prior = PRIOR_ACCEPTANCE if self.measured is None else self.measured.rate
            found = self.acceptance[seq] = Acceptance(prior=prior)
        return found

    def _observe(self, seq: Request, num_drafts: int, num_accepted: int) -> None:
        self._acceptance(seq).observe(num_drafts, num_accepted)
        if self.measured is not None:
            self.measured.observe(num_drafts, num_accepted)
