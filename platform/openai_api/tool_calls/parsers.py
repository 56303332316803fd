"""The parsers by vLLM's `--tool-call-parser` names, and which one a tokenizer implies."""

from __future__ import annotations

from .formats import HermesStream, Llama3Stream, MistralStream, ToolStream
from .output import ParsedOutput


class ToolParser:
    name = ""
    stream_class: type[ToolStream] = ToolStream

    def stream(self) -> ToolStream:
        return self.stream_class()

    def parse(self, text: str) -> ParsedOutput:
        """The whole output: a stream fed all of it, so it agrees with any chunked stream."""
        stream = self.stream()
        deltas = stream.feed(text) + stream.end()
        if stream.malformed or not stream.tool_calls:
            return ParsedOutput(content=text, tool_calls=[])
        content = "".join(delta.get("content", "") for delta in deltas)
        return ParsedOutput(content=content or None, tool_calls=stream.tool_calls)


class HermesParser(ToolParser):
    name = "hermes"
    stream_class = HermesStream


class Llama3JsonParser(ToolParser):
    name = "llama3_json"
    stream_class = Llama3Stream


class MistralParser(ToolParser):
    name = "mistral"
    stream_class = MistralStream


PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesParser,
    "llama3_json": Llama3JsonParser,
    "mistral": MistralParser,
}


def choose_parser(tokenizer, override: str | None = None) -> str:
    """The override if given, else the format the tokenizer's special tokens or template imply."""
    if override is not None:
        if override not in PARSERS:
            raise ValueError(f"unknown tool-call parser {override!r}; choose one of {', '.join(PARSERS)}")
        return override
    tokens = _vocabulary(tokenizer)
    template = _template_source(tokenizer)
    if "[TOOL_CALLS]" in tokens:
        return "mistral"
    if "<|python_tag|>" in tokens or "<|python_tag|>" in template or "ipython" in template:
        return "llama3_json"
    return "hermes"


def _vocabulary(tokenizer) -> set[str]:
    tokens: set[str] = set()
    for method in ("get_vocab", "get_added_vocab"):
        if callable(getattr(tokenizer, method, None)):
            tokens.update(getattr(tokenizer, method)())
    tokens.update(str(token) for token in getattr(tokenizer, "additional_special_tokens", None) or ())
    return tokens


def _template_source(tokenizer) -> str:
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):  # several named templates ("default", "tool_use")
        return "\n".join(str(t) for t in template.values())
    return template if isinstance(template, str) else ""
