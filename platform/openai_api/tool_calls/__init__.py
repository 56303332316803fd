"""OpenAI tool calling, the model-format side: parsing tool calls out of model text, forced choices.

A model writes its tool calls as text in its own format (vLLM's `--tool-call-parser` names):

  hermes       <tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>, any number of blocks,
               text outside them is content (Qwen2.5, Hermes, and what Tessera asks ChatML
               models such as SmolLM2 to write: generation.tokenization's fallback prompt)
  llama3_json  the whole output, optionally after <|python_tag|>, is {"name": .., "parameters": {..}}
               (or "arguments"), several separated by ";"; an output that is not such JSON is content
  mistral      [TOOL_CALLS] [{"name": .., "arguments": {..}}, ...]; text before the marker is content

Each parser reads a whole output (parse) or a stream of text deltas (stream), and both give the
same answer for any chunking of the same text, because both run the same character-driven
reader: parse() is a stream fed the whole text at once.

Arguments are the model's JSON re-serialised as it arrives, json.dumps-style (", ", ": ",
ensure_ascii=False): equal to json.dumps(json.loads(raw), ensure_ascii=False) for any object
without duplicate keys. So a stream can send argument fragments before a call is complete, and
the fragments still add up to exactly what parse() returns.

Forced choices (tool_choice "required" or a named function) are enforced by the engine's grammar
(forced_spec), and read back with parse_forced / forced_stream.

  output.py       ToolCall, ParsedOutput: what reading an output gives
  json_reader.py  JSON a character at a time (JsonWriter) and one call object (CallReader)
  formats.py      the format streams (ToolStream and one subclass per format)
  parsers.py      the parsers by name (PARSERS) and choose_parser
  forced.py       forced choices: the grammar (forced_spec) and reading it back
  validation.py   validate_tools: tools, tool_choice, parallel_tool_calls as the API accepts them
"""

from __future__ import annotations

from .forced import forced_name, forced_spec, forced_stream, parse_forced
from .formats import ToolStream
from .json_reader import ARGUMENT_KEYS
from .output import ParsedOutput, ToolCall, new_call_id
from .parsers import PARSERS, HermesParser, Llama3JsonParser, MistralParser, ToolParser, choose_parser
from .validation import FUNCTION_NAME, validate_tools

__all__ = [
    "ARGUMENT_KEYS",
    "FUNCTION_NAME",
    "PARSERS",
    "HermesParser",
    "Llama3JsonParser",
    "MistralParser",
    "ParsedOutput",
    "ToolCall",
    "ToolParser",
    "ToolStream",
    "choose_parser",
    "forced_name",
    "forced_spec",
    "forced_stream",
    "new_call_id",
    "parse_forced",
    "validate_tools",
]
