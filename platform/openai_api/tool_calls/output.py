"""What reading a model's output for tool calls gives: the calls (OpenAI's shape) and the content."""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field


def new_call_id() -> str:
    """OpenAI's shape: "call_" and 24 hex characters."""
    return "call_" + secrets.token_hex(12)


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text, as OpenAI returns it (clients json.loads it themselves)

    def as_openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class ParsedOutput:
    content: str | None  # None when the output was only tool calls: OpenAI sends null, not ""
    tool_calls: list[ToolCall] = field(default_factory=list)
