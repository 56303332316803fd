"""Fold usage rows into per (hour, user, key, model, source) cells. Pure Python, no Django queries.

The roll-up task stores these cells as UsageHourly rows, and the selectors fold the not yet
rolled-up usage with the same code, so the live hour and the roll-ups always agree.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime

from . import histogram

CellKey = tuple[datetime, int | None, int | None, str, str]  # hour, user_id, api_key_id, model, source


@dataclass(frozen=True)
class UsageRow:
    """One usage record as the dashboard needs it (see usage_source.normalized_rows)."""

    created_at: datetime
    user_id: int | None
    api_key_id: int | None
    model: str
    source: str
    status: int
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    ttft_ms: float | None
    latency_ms: float | None

    @property
    def ok(self) -> bool:
        return self.status < 400

    @property
    def tpot_ms(self) -> float | None:
        """Time per output token after the first, the way vLLM's benchmarks define TPOT."""
        if self.ttft_ms is None or self.latency_ms is None or self.completion_tokens < 2:
            return None
        return max(self.latency_ms - self.ttft_ms, 0.0) / (self.completion_tokens - 1)


@dataclass
class Cell:
    requests: int = 0
    errors: int = 0
    rate_limited: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    ttft_ms_sum: float = 0.0
    latency_ms_sum: float = 0.0
    ttft_hist: dict = field(default_factory=dict)
    tpot_hist: dict = field(default_factory=dict)
    latency_hist: dict = field(default_factory=dict)

    def add(self, row: UsageRow) -> None:
        self.requests += 1
        self.prompt_tokens += row.prompt_tokens
        self.completion_tokens += row.completion_tokens
        self.cached_tokens += row.cached_tokens
        if not row.ok:
            self.errors += 1
            self.rate_limited += row.status == 429
            return
        # Latency statistics describe served requests; a refusal's few ms would drag p50 down.
        if row.ttft_ms is not None:
            self.ttft_ms_sum += row.ttft_ms
            histogram.add(self.ttft_hist, row.ttft_ms)
        if row.latency_ms is not None:
            self.latency_ms_sum += row.latency_ms
            histogram.add(self.latency_hist, row.latency_ms)
        if (tpot := row.tpot_ms) is not None:
            histogram.add(self.tpot_hist, tpot)


def floor_hour(moment: datetime) -> datetime:
    return moment.replace(minute=0, second=0, microsecond=0)


def fold(rows) -> dict[CellKey, Cell]:
    cells: dict[CellKey, Cell] = {}
    for row in rows:
        key = (floor_hour(row.created_at), row.user_id, row.api_key_id, row.model, row.source)
        cell = cells.get(key)
        if cell is None:
            cell = cells[key] = Cell()
        cell.add(row)
    return cells


SUM_FIELDS = (
    "requests",
    "errors",
    "rate_limited",
    "prompt_tokens",
    "completion_tokens",
    "cached_tokens",
    "ttft_ms_sum",
    "latency_ms_sum",
)
HIST_FIELDS = ("ttft_hist", "tpot_hist", "latency_hist")


def merge_sums(into: Cell, sums) -> Cell:
    """Add counters from a Cell, a model instance or a mapping with the SUM_FIELDS names."""
    get = sums.get if isinstance(sums, dict) else (lambda name: getattr(sums, name))
    for name in SUM_FIELDS:
        setattr(into, name, getattr(into, name) + (get(name) or 0))
    return into


def merge_hists(into: Cell, hists) -> Cell:
    get = hists.get if isinstance(hists, dict) else (lambda name: getattr(hists, name))
    for name in HIST_FIELDS:
        histogram.merge(getattr(into, name), get(name) or {})
    return into
