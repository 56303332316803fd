"""Mergeable latency histograms with a bounded relative error (the DDSketch idea).

A value v > 0 falls in bucket i = ceil(log_gamma(v)); every bucket reports one representative
value that is within RELATIVE_ACCURACY of every value in it. Hourly roll-ups store the bucket
counts, and any range of hours merges by adding counts, so p50/p95/p99 over a day or a month come
from the roll-ups with the same error bound as over one hour. Pure Python, no Django.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

RELATIVE_ACCURACY = 0.01
GAMMA = (1 + RELATIVE_ACCURACY) / (1 - RELATIVE_ACCURACY)
_LOG_GAMMA = math.log(GAMMA)
# Latencies are milliseconds; anything under a microsecond counts as the smallest bucket.
MIN_VALUE = 1e-3

Histogram = dict[str, int]  # bucket index (as a JSON-friendly str) -> count


def bucket_of(value: float) -> int:
    return math.ceil(math.log(max(value, MIN_VALUE)) / _LOG_GAMMA)


def representative(bucket: int) -> float:
    """The value whose relative distance to both bucket bounds is equal (<= RELATIVE_ACCURACY)."""
    return 2 * GAMMA**bucket / (GAMMA + 1)


def build(values: Iterable[float]) -> Histogram:
    hist: Histogram = {}
    for value in values:
        add(hist, value)
    return hist


def add(hist: Histogram, value: float, count: int = 1) -> None:
    key = str(bucket_of(value))
    hist[key] = hist.get(key, 0) + count


def merge(into: Histogram, other: Mapping[str, int]) -> Histogram:
    for key, count in other.items():
        into[key] = into.get(key, 0) + count
    return into


def total(hist: Mapping[str, int]) -> int:
    return sum(hist.values())


def quantile(hist: Mapping[str, int], q: float) -> float | None:
    """The q-quantile (0..1) of the values counted, as numpy's percentile(method="lower") ranks it:
    the value at sorted index floor(q * (n - 1)), to within RELATIVE_ACCURACY. None when empty."""
    n = total(hist)
    if n == 0:
        return None
    rank = math.floor(q * (n - 1))
    seen = 0
    for bucket in sorted(int(k) for k in hist):
        seen += hist[str(bucket)]
        if seen > rank:
            return representative(bucket)
    raise AssertionError("unreachable: rank < n")


def quantiles(hist: Mapping[str, int], qs: Iterable[float] = (0.5, 0.95, 0.99)) -> dict[str, float | None]:
    """{"p50": ..., "p95": ..., "p99": ...} rounded to 0.01 ms for display."""
    out = {}
    for q in qs:
        value = quantile(hist, q)
        out[f"p{round(q * 100):d}"] = None if value is None else round(value, 2)
    return out
