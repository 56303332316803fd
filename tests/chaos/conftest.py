"""The chaos suite (`make chaos`, marker `chaos`): the real stack on loopback, one fault per scenario.

Each scenario records what it measured with the `chaos_report` fixture; at the end of the run the
table is printed and written to var/chaos-report.md (the README's "Reliability" table is copied from it).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.run_report import write_report

REPORT = Path(__file__).resolve().parents[2] / "var" / "chaos-report.md"
_ROWS: list[tuple[str, str, str]] = []


@pytest.fixture
def chaos_report(request):
    """record(outcome, figures): one table row for this scenario (the test's docstring names the fault)."""
    fault = (request.node.function.__doc__ or request.node.name).strip().splitlines()[0]

    def record(outcome: str, figures: str) -> None:
        _ROWS.append((fault, outcome, figures))

    return record


def pytest_terminal_summary(terminalreporter):
    write_report(
        terminalreporter,
        section="chaos: scenarios and figures",
        headers=["fault injected", "outcome", "measured"],
        rows=_ROWS,
        path=REPORT,
    )
