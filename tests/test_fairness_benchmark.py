"""benchmarks/fairness.py: the service and backlog curves its tables are made of, and a brief run through the
stack."""

import math

import pytest

from benchmarks import fairness


def test_service_is_spread_over_first_to_last_token():
    done = fairness.Streamed("A", sent=0.0, first=1.0, last=3.0, tokens=10)  # 4 prompt + 2 x 10 output = 24
    never_started = fairness.Streamed("B", sent=0.0)
    curves = fairness.service_curves([done, never_started], start=0.0, seconds=4.0, prompt=4, step=1.0)
    assert curves["A"] == [0.0, 0.0, 12.0, 24.0, 24.0]
    assert curves["B"] == [0.0] * 5


def test_backlog_counts_waiting_and_in_flight_requests_and_a_gap_inside_a_cell_breaks_the_backlog():
    records = [
        fairness.Streamed("A", sent=0.2, first=1.5, last=2.1, done=2.1),
        fairness.Streamed("A", sent=1.7, first=2.2, last=3.0, done=3.0),  # A waits for nothing in (1.5, 1.7)
        fairness.Streamed("A", sent=2.5),  # cut at the window's end: waiting and in flight to the end
        fairness.Streamed("B", sent=0.1, error="HTTP 429", done=0.3),  # refused: no longer waiting
    ]
    curves = fairness.backlog_curves(records, grid=[0.0, 1.0, 2.0, 3.0])
    assert curves["A"]["waiting"] == [0, 1, 1, 1]
    assert curves["A"]["in_flight"] == [0, 1, 2, 1]
    assert curves["A"]["backlogged"] == [False, False, False, False]  # cell (2, 3] has no one waiting at 2.2-2.5
    assert curves["B"]["in_flight"] == [0, 0, 0, 0]
    steady = [fairness.Streamed("A", sent=0.5, first=2.5), fairness.Streamed("A", sent=2.4, first=3.5)]
    # backlogged from 0.5 s on: cell (0, 1] is not throughout
    assert fairness.backlog_curves(steady, grid=[0.0, 1.0, 2.0, 3.0])["A"]["backlogged"] == [False, False, True, True]


def test_the_backlogged_difference_is_the_spread_of_w_a_minus_w_b_inside_each_stretch():
    times = [0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0]
    diffs = [0.0, 500.0, 480.0, 700.0, 650.0, 2000.0, 2100.0]
    both = [False, False, True, True, True, False, True]  # cells (1, 4] and (5, 6]
    result = fairness.backlogged_diff(times, diffs, both)
    assert result["max_diff"] == 220.0  # 700 - 480 over [1, 4]; the jump at 5 is outside every stretch
    assert result["longest"] == (1.0, 4.0)
    assert result["covered"] == pytest.approx(4 / 6)
    assert fairness.backlog_cell(result) == "1.0-4.0 s (67%)"
    never = fairness.backlogged_diff(times, diffs, [False] * 7)
    assert math.isnan(never["max_diff"]) and fairness.backlog_cell(never) == "never"


def test_a_percentile_of_few_values_is_numpys_and_never_past_the_largest():
    ttfts = [float(v) for v in range(1, 63)] + [200.0]  # 63 first tokens, one stall
    assert fairness.pct(ttfts, 99) == pytest.approx(62.0 + 0.38 * (200.0 - 62.0))  # numpy.percentile(ttfts, 99)
    assert fairness.pct(ttfts, 99) < max(ttfts)
    assert fairness.pct(ttfts, 50) == 32.0
    assert math.isnan(fairness.pct([5.0], 99))


@pytest.mark.slow
def test_a_brief_stack_run_prints_both_policies_the_weighted_users_and_the_interactive_user(capsys):
    argv = ["--seconds", "4", "--rate", "1", "--interactive-seconds", "3", "--interactive-interval", "1", "--no-vllm"]
    report = fairness.main(argv)
    rows = [line for line in report.splitlines() if line.startswith("| fcfs |") or line.startswith("| fair |")]
    assert {row.split("|")[1].strip() for row in rows} == {"fcfs", "fair"}
    assert "Through the stack (bench, 1 worker(s)): B at 2x A's rate" in report
    shares = [line.split("|") for line in report.splitlines() if line.startswith("| w")]
    assert [row[1].strip() for row in shares] == ["w1", "w2", "w3", "w4"]
    assert abs(sum(float(row[3]) for row in shares) - 1.0) < 0.03  # service shares of the four users
    assert "| alone |" in report and "| flood |" in report
    per_round = [line.split("|") for line in report.splitlines() if line.startswith("| 1 |")]
    assert len(per_round) == 1 and float(per_round[0][4]) > 0  # round 1's fair / fcfs throughput
