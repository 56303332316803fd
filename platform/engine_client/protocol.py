"""Redis key names and message codecs of the engine protocol (docs/protocol.md).

The engine worker (inference/worker.py) keeps its own copy of these names because inference/ never
imports platform code; tests/inference/test_worker.py checks that both copies agree.
"""
from __future__ import annotations

import json

PREFIX = "tessera:engine"
REQUEST_STREAM = f"{PREFIX}:requests"
CONSUMER_GROUP = "engines"
ABORT_CHANNEL = f"{PREFIX}:abort"
WORKERS_SET = f"{PREFIX}:workers"

# Priority classes (lower runs first in the engine); a request's own priority orders it inside its class.
PRIORITY_CLASSES = {"interactive": 0, "api": 1, "batch": 2}
PRIORITY_CLASS_SPAN = 1000

TERMINAL_EVENTS = ("finish", "error")


def output_stream(request_id: str) -> str:
    return f"{PREFIX}:out:{request_id}"


def aborted_key(request_id: str) -> str:
    return f"{PREFIX}:aborted:{request_id}"


def heartbeat_key(worker_id: str) -> str:
    return f"{PREFIX}:worker:{worker_id}"


def block_map_key(worker_id: str) -> str:
    return f"{PREFIX}:worker:{worker_id}:blocks"


def engine_priority(priority_class: str, priority: int = 0) -> int:
    """Map (class, in-class priority) onto the engine's single integer (lower value runs first)."""
    if priority_class not in PRIORITY_CLASSES:
        raise ValueError(f"unknown priority class {priority_class!r}")
    within = min(max(int(priority), 0), PRIORITY_CLASS_SPAN - 1)
    return PRIORITY_CLASSES[priority_class] * PRIORITY_CLASS_SPAN + within


def encode(obj) -> str:
    return json.dumps(obj, separators=(",", ":"))


def decode(raw) -> object:
    if isinstance(raw, bytes):
        raw = raw.decode()
    return json.loads(raw)
