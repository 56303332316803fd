"""Engine metrics in vLLM's names and meanings.

The worker publishes snapshot() in its heartbeat; the web tier's /metrics exports it under vLLM's
`vllm:` names (platform/openai_api/metrics.py, docs/metrics.md).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

LATENCY_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)


@dataclass
class Histogram:
    buckets: tuple[float, ...] = LATENCY_BUCKETS
    counts: list[int] = field(default_factory=lambda: [0] * (len(LATENCY_BUCKETS) + 1))
    total: float = 0.0
    count: int = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.total += value
        self.count += 1

    def to_dict(self) -> dict:
        """Per-bucket counts (the last one above every bound), not cumulative: cumulative() makes those."""
        return {"buckets": list(self.buckets), "counts": list(self.counts), "sum": self.total, "count": self.count}


def cumulative(histogram: dict) -> list[tuple[float, int]]:
    """(upper bound, observations <= it) of a to_dict() histogram, ending with (inf, count): Prometheus' le buckets."""
    bounds = [*histogram["buckets"], float("inf")]
    running, pairs = 0, []
    for bound, count in zip(bounds, histogram["counts"]):
        running += count
        pairs.append((bound, running))
    return pairs


@dataclass
class EngineMetrics:
    """Counters and histograms updated every step; gauges (and preemptions) are read from the scheduler."""

    prompt_tokens_total: int = 0
    generation_tokens_total: int = 0
    requests_finished_total: int = 0
    finished_reasons: dict[str, int] = field(default_factory=dict)  # vLLM's request_success_total
    time_to_first_token_seconds: Histogram = field(default_factory=Histogram)
    time_per_output_token_seconds: Histogram = field(default_factory=Histogram)
    e2e_request_latency_seconds: Histogram = field(default_factory=Histogram)
    request_queue_time_seconds: Histogram = field(default_factory=Histogram)
    peak_allocated_slots: int = 0
    real_tokens_at_peak: int = 0
    # speculative decoding (vLLM's spec_decode_* counters): verifications, proposed and accepted tokens,
    # and per proposal position how often it was accepted
    spec_decode_num_drafts: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    spec_decode_num_accepted_tokens_per_pos: list[int] = field(default_factory=list)

    def observe_finished(self, metrics, num_output_tokens: int, finished_reason: str) -> None:
        self.requests_finished_total += 1
        self.finished_reasons[finished_reason] = self.finished_reasons.get(finished_reason, 0) + 1
        if metrics.finished_time is not None:
            self.e2e_request_latency_seconds.observe(metrics.finished_time - metrics.arrival_time)
        if metrics.first_token_time is not None and num_output_tokens > 1 and metrics.finished_time:
            tpot = (metrics.finished_time - metrics.first_token_time) / (num_output_tokens - 1)
            self.time_per_output_token_seconds.observe(tpot)

    def observe_kv_fill(self, allocated_slots: int, real_tokens: int) -> None:
        if allocated_slots > self.peak_allocated_slots:
            self.peak_allocated_slots, self.real_tokens_at_peak = allocated_slots, real_tokens

    def observe_spec_decode(self, num_draft_tokens: int, num_accepted: int) -> None:
        self.spec_decode_num_drafts += 1
        self.spec_decode_num_draft_tokens += num_draft_tokens
        self.spec_decode_num_accepted_tokens += num_accepted
        per_pos = self.spec_decode_num_accepted_tokens_per_pos
        per_pos.extend([0] * (num_draft_tokens - len(per_pos)))
        for position in range(num_accepted):
            per_pos[position] += 1

    def spec_decode(self) -> dict:
        """vLLM's counters with the two figures spec_decode_acceptance derives from them."""
        drafts, proposed, accepted = (
            self.spec_decode_num_drafts,
            self.spec_decode_num_draft_tokens,
            self.spec_decode_num_accepted_tokens,
        )
        rate, length = spec_decode_acceptance(drafts, proposed, accepted)
        return {
            "spec_decode_num_drafts_total": drafts,
            "spec_decode_num_draft_tokens_total": proposed,
            "spec_decode_num_accepted_tokens_total": accepted,
            "spec_decode_num_accepted_tokens_per_pos": list(self.spec_decode_num_accepted_tokens_per_pos),
            "spec_decode_acceptance_rate": rate,
            "spec_decode_mean_acceptance_length": length,
        }

    @property
    def kv_fill_at_peak(self) -> float:
        return self.real_tokens_at_peak / self.peak_allocated_slots if self.peak_allocated_slots else 0.0

    def histograms(self) -> dict:
        return {
            "time_to_first_token_seconds": self.time_to_first_token_seconds.to_dict(),
            "time_per_output_token_seconds": self.time_per_output_token_seconds.to_dict(),
            "e2e_request_latency_seconds": self.e2e_request_latency_seconds.to_dict(),
            "request_queue_time_seconds": self.request_queue_time_seconds.to_dict(),
        }

    def snapshot(self) -> dict:
        """What the heartbeat adds to get_stats(), JSON-able; taken on the engine's thread, so counts and sums agree."""
        return {
            "request_success_total": dict(self.finished_reasons),
            "histograms": self.histograms(),
        }


def spec_decode_acceptance(drafts: int, proposed: int, accepted: int) -> tuple[float, float]:
    """The acceptance rate (accepted / proposed) and the mean acceptance length (1 + accepted / drafts:
    tokens per verifying step, vLLM's formula); 0.0 for each while nothing was speculated."""
    return (accepted / proposed if proposed else 0.0, 1 + accepted / drafts if drafts else 0.0)
