"""The latency histogram: quantiles within the promised relative error, merge = histogram of the union."""

import random

import numpy as np
import pytest

from dashboard import histogram


def _values(seed: int, n: int) -> list[float]:
    rng = random.Random(seed)
    return [rng.lognormvariate(4, 1.2) for _ in range(n)]


@pytest.mark.parametrize("q", [0.0, 0.5, 0.9, 0.95, 0.99, 1.0])
def test_quantile_is_within_relative_accuracy_of_numpy_lower(q):
    values = _values(1, 5000)
    expected = float(np.percentile(values, q * 100, method="lower"))
    got = histogram.quantile(histogram.build(values), q)
    assert abs(got - expected) <= histogram.RELATIVE_ACCURACY * expected


def test_merge_equals_histogram_of_all_values():
    a, b = _values(2, 700), _values(3, 300)
    merged = histogram.merge(histogram.build(a), histogram.build(b))
    assert merged == histogram.build(a + b)
    assert histogram.total(merged) == 1000


def test_empty_histogram_has_no_quantiles():
    assert histogram.quantile({}, 0.5) is None
    assert histogram.quantiles({}) == {"p50": None, "p95": None, "p99": None}


def test_tiny_values_are_clamped_not_lost():
    hist = histogram.build([0.0, 1e-9, 5.0])
    assert histogram.total(hist) == 3
    assert histogram.quantile(hist, 1.0) == pytest.approx(5.0, rel=histogram.RELATIVE_ACCURACY)
