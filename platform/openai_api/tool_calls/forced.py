"""Forced choices (tool_choice "required" or a named function): the engine's grammar that
enforces them (forced_spec), and the streams that read the forced output back."""

from __future__ import annotations

from .formats import ArrayStream, ToolStream
from .json_reader import JsonWriter, Malformed
from .output import ParsedOutput


def forced_name(tool_choice) -> str | None:
    """The function a named tool_choice forces, else None."""
    if isinstance(tool_choice, dict):
        return tool_choice["function"]["name"]
    return None


def forced_spec(tools: list[dict], tool_choice, parallel_tool_calls: bool = True) -> dict | None:
    """The structured_outputs spec that makes the model write the forced call(s), or None."""
    name = forced_name(tool_choice)
    if name is not None:
        return {"json": tool_parameters(next(t for t in tools if t["function"]["name"] == name))}
    if tool_choice != "required":
        return None
    # vLLM's shape: an array of {"name", "parameters"} objects, one alternative per tool.
    items = {
        "anyOf": [
            {
                "type": "object",
                "properties": {"name": {"const": tool["function"]["name"]}, "parameters": tool_parameters(tool)},
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
            for tool in tools
        ]
    }
    schema = {"type": "array", "minItems": 1, "items": items}
    if parallel_tool_calls is False:
        schema["maxItems"] = 1
    return {"json": schema}


def tool_parameters(tool: dict) -> dict:
    return tool["function"].get("parameters") or {"type": "object"}


class _NamedStream(ToolStream):
    """A named tool_choice: the whole output is that function's arguments (the grammar sees to it)."""

    def __init__(self, name: str):
        super().__init__()
        self._name = name
        self._writer = JsonWriter()

    def feed(self, text: str) -> list[dict]:
        self._header()
        try:
            for c in text:
                self._writer.feed(c)
        except Malformed:  # not possible under the grammar; what was read stands
            self.malformed = True
            self._writer.done = True
        self._send_arguments(0, self._writer.take())
        return self._take()

    def end(self) -> list[dict]:
        self._header()
        try:
            self._writer.finish()
        except Malformed:
            self.malformed = True
        self._send_arguments(0, self._writer.take())
        self.malformed = self.malformed or not self._writer.done  # cut off by max_tokens
        return self._take()

    def _header(self) -> None:
        if not self.tool_calls:
            self._send_header(self._name)


class _RequiredStream(ArrayStream):
    """tool_choice "required": the whole output is a JSON array of {"name", "parameters"} (the grammar's)."""

    def __init__(self):
        super().__init__()
        self._open_block()

    def _send_content(self, text: str) -> None:
        pass  # the grammar leaves no room for content, and broken text is not worth sending


def forced_stream(tool_choice) -> ToolStream:
    """The stream for a forced output: same feed/end/tool_calls as a parser's stream."""
    name = forced_name(tool_choice)
    if name is not None:
        return _NamedStream(name)
    if tool_choice == "required":
        return _RequiredStream()
    raise ValueError(f"tool_choice {tool_choice!r} does not force a call")


def parse_forced(text: str, tool_choice) -> ParsedOutput:
    """A whole forced output read back: the same reader as forced_stream, so the two agree."""
    stream = forced_stream(tool_choice)
    stream.feed(text)
    stream.end()
    return ParsedOutput(content=None, tool_calls=stream.tool_calls)
