"""One generation lifecycle: usage rows, quota reservations and engine submissions happen in the
generation service only; the front doors (chat, openai_api, batches) are adapters around it."""

from __future__ import annotations

import ast
from pathlib import Path

PLATFORM = Path(__file__).resolve().parents[1] / "platform"
SERVICE = PLATFORM / "generation" / "services.py"


def calls_named(name: str, skip_receiver: str = "") -> set[Path]:
    """Platform files (migrations aside) that call a function or method with this name (not on skip_receiver)."""
    found = set()
    for path in PLATFORM.rglob("*.py"):
        if "migrations" in path.parts:
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Call):
                func = node.func
                called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
                receiver = getattr(getattr(func, "value", None), "id", None)
                if called == name and not (skip_receiver and receiver == skip_receiver):
                    found.add(path)
    return found


def test_usage_is_recorded_by_the_generation_service_only():
    assert calls_named("record_usage") == {SERVICE}


def test_quota_is_reserved_by_the_generation_service_only():
    assert calls_named("reserve") - {PLATFORM / "quotas" / "services.py"} == {SERVICE}


def test_engine_requests_are_submitted_by_the_generation_service_only():
    assert calls_named("submit", skip_receiver="generation") == {SERVICE}  # generation.submit(gen) is the way
