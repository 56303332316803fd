"""benchmarks/fairness.py: the service curves its tables are made of, and a brief run through the stack."""

import pytest

from benchmarks import fairness


def test_service_is_spread_over_first_to_last_token():
    done = fairness.Streamed("A", sent=0.0, first=1.0, last=3.0, tokens=10)  # 4 prompt + 2 x 10 output = 24
    never_started = fairness.Streamed("B", sent=0.0)
    curves = fairness.service_curves([done, never_started], start=0.0, seconds=4.0, prompt=4, step=1.0)
    assert curves["A"] == [0.0, 0.0, 12.0, 24.0, 24.0]
    assert curves["B"] == [0.0] * 5


@pytest.mark.slow
def test_a_brief_stack_run_prints_both_policies_the_weighted_users_and_the_interactive_user(capsys):
    argv = ["--stack", "--seconds", "4", "--rate", "1", "--interactive-seconds", "3", "--interactive-interval", "1"]
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
