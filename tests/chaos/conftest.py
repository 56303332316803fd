"""The chaos suite (`make chaos`, marker `chaos`): the real stack on loopback, one fault per scenario.

Each scenario records what it measured with the `chaos_report` fixture; at the end of the run the
table is printed and written to var/chaos-report.md (the README's "Reliability" table is copied from it).
"""

from __future__ import annotations

from pathlib import Path

import pytest

REPORT = Path(__file__).resolve().parents[2] / "var" / "chaos-report.md"
_ROWS: list[tuple[str, str, str]] = []


@pytest.fixture
def chaos_report(request):
    """record(outcome, figures): one table row for this scenario (the test's docstring names the fault)."""
    fault = (request.node.function.__doc__ or request.node.name).strip().splitlines()[0]

    def record(outcome: str, figures: str) -> None:
        _ROWS.append((fault, outcome, figures))

    return record


def report_table(rows: list[tuple[str, str, str]]) -> str:
    lines = ["| fault injected | outcome | measured |", "|---|---|---|"]
    lines += [f"| {fault} | {outcome} | {figures} |" for fault, outcome, figures in rows]
    return "\n".join(lines) + "\n"


def pytest_terminal_summary(terminalreporter):
    if not _ROWS:
        return
    table = report_table(_ROWS)
    REPORT.parent.mkdir(parents=True, exist_ok=True)
    REPORT.write_text(table)
    terminalreporter.section("chaos: scenarios and figures")
    terminalreporter.write(table)
    terminalreporter.write_line(f"(written to {REPORT})")
