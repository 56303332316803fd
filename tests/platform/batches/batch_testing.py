"""Helpers shared by the batch tests (a plain module: conftest.py is not importable)."""

from __future__ import annotations

import json

MODEL_NAME = "tiny"


def chat_line(custom_id: str, content: str = "Hello", max_tokens: int = 4, **body) -> dict:
    return {
        "custom_id": custom_id,
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {
            "model": MODEL_NAME,
            "messages": [{"role": "user", "content": content}],
            "max_tokens": max_tokens,
            "temperature": 0.0,
            **body,
        },
    }


def jsonl(lines) -> bytes:
    return "".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines).encode()
