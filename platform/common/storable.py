"""Text as the database can keep it. PostgreSQL's text and jsonb cannot hold the NUL character (SQLite's
can), and a model can produce one (a byte-level token for 0x00): what is stored of a model's output
keeps U+FFFD in its place, on both databases. What a client is streamed or answered is left as is."""

from __future__ import annotations

NUL, REPLACEMENT = "\x00", "\ufffd"


def storable(value):
    """value (a string, or JSON-like lists and dicts of them) with every NUL replaced by U+FFFD."""
    if isinstance(value, str):
        return value.replace(NUL, REPLACEMENT)
    if isinstance(value, dict):
        return {storable(k): storable(v) for k, v in value.items()}
    if isinstance(value, list):
        return [storable(v) for v in value]
    return value


def holds_nul(value) -> bool:
    """Whether a string anywhere in value (JSON-like) holds a NUL."""
    if isinstance(value, str):
        return NUL in value
    if isinstance(value, dict):
        return any(holds_nul(k) or holds_nul(v) for k, v in value.items())
    if isinstance(value, list):
        return any(holds_nul(v) for v in value)
    return False
