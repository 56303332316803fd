"""The table a suite outside `make test` (chaos, compat) prints at its end and writes under var/."""

from __future__ import annotations

from pathlib import Path


def markdown_table(headers: list[str], rows: list[tuple[str, ...]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def write_report(terminalreporter, *, section: str, headers: list[str], rows: list, path: Path) -> None:
    """Print the rows' table in its own section of pytest's summary and write it to path (nothing when no rows)."""
    if not rows:
        return
    table = markdown_table(headers, rows)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(table)
    terminalreporter.section(section)
    terminalreporter.write(table)
    terminalreporter.write_line(f"(written to {path})")
