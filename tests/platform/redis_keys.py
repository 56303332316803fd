"""The engine protocol's Redis keys as docs/protocol.md names them, for tests that watch a live stack
from outside (through Redis, as any client would) without importing the code under test."""
from __future__ import annotations

import json

PREFIX = "tessera:engine"
WORKERS_SET = f"{PREFIX}:workers"
TERMINAL_EVENTS = ("finish", "error")


def output_stream(request_id: str) -> str:
    return f"{PREFIX}:out:{request_id}"


def aborted_key(request_id: str) -> str:
    return f"{PREFIX}:aborted:{request_id}"


def heartbeat_key(worker_id: str) -> str:
    return f"{PREFIX}:worker:{worker_id}"


def decode(raw) -> object:
    return json.loads(raw.decode() if isinstance(raw, bytes) else raw)
