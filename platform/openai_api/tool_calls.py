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
"""
from __future__ import annotations

import json
import math
import re
import secrets
from dataclasses import dataclass, field

from errors import InvalidRequest

ARGUMENT_KEYS = ("arguments", "parameters")  # hermes/mistral say arguments, llama 3 parameters
FUNCTION_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")  # OpenAI's rule for function names


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


# ---------------------------------------------------------------- JSON, a character at a time

class _Malformed(Exception):
    """The text stopped being what the format promised."""


_WS = " \t\n\r"
_HEX = set("0123456789abcdefABCDEF")
_SCALAR_STARTS = set("-0123456789tfn")
_SCALAR_CHARS = set("0123456789+-.eE") | set("truefalsn")
_NUMBER = re.compile(r"-?(?:0|[1-9]\d*)(?:\.\d+)?(?:[eE][+-]?\d+)?\Z")
_LITERALS = ("true", "false", "null")
_ESCAPES = {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t"}


class _JsonWriter:
    """One JSON value read a character at a time, written back json.dumps-style as it arrives.

    Punctuation is written when seen, numbers and literals when they end, string characters as
    soon as their escape is complete: `out` collects the text, take() hands it over. Raises
    _Malformed where json.loads would refuse the text (and for NaN/Infinity, which it allows).
    """

    def __init__(self):
        self.out: list[str] = []
        self.done = False
        self._stack: list[str] = []  # the open "{" and "["
        self._expect = "value"  # value | first_value | key | first_key | colon | after
        self._string: str | None = None  # "key" or "value" while inside a string
        self._escape = ""  # the raw text of an escape not yet complete
        self._scalar = ""  # a number or literal being read

    def take(self) -> str:
        text = "".join(self.out)
        self.out.clear()
        return text

    def feed(self, c: str) -> bool:
        """Read one character; False when the value had already ended before it."""
        if self.done:
            return False
        if self._string is not None:
            self._string_char(c)
            return True
        if self._scalar:
            if c in _SCALAR_CHARS:
                self._scalar += c
                return True
            self._end_scalar()
            if self.done:
                return False
        if c not in _WS:
            self._structure(c)
        return True

    def finish(self) -> None:
        """End of text: a top-level number or literal ends here (nothing else can)."""
        if self._scalar and not self._stack:
            self._end_scalar()

    def _structure(self, c: str) -> None:
        expect = self._expect
        if expect == "after":
            self._after_value(c)
        elif expect in ("key", "first_key"):
            if c == '"':
                self._open_string("key")
            elif c == "}" and expect == "first_key":
                self._close()
            else:
                raise _Malformed
        elif expect == "colon":
            if c != ":":
                raise _Malformed
            self.out.append(": ")
            self._expect = "value"
        elif c == "]" and expect == "first_value":
            self._close()
        else:
            self._open_value(c)

    def _open_value(self, c: str) -> None:
        if c in "{[":
            self._stack.append(c)
            self.out.append(c)
            self._expect = "first_key" if c == "{" else "first_value"
        elif c == '"':
            self._open_string("value")
        elif c in _SCALAR_STARTS:
            self._scalar = c
        else:
            raise _Malformed

    def _after_value(self, c: str) -> None:
        if c == ",":
            self.out.append(", ")
            self._expect = "key" if self._stack[-1] == "{" else "value"
        elif c == {"{": "}", "[": "]"}[self._stack[-1]]:
            self._close()
        else:
            raise _Malformed

    def _close(self) -> None:
        self.out.append("}" if self._stack.pop() == "{" else "]")
        self._value_done()

    def _value_done(self) -> None:
        if self._stack:
            self._expect = "after"
        else:
            self.done = True

    def _end_scalar(self) -> None:
        text, self._scalar = self._scalar, ""
        if text in _LITERALS:
            self.out.append(text)
        elif _NUMBER.match(text):
            self.out.append(_normal_number(text))
        else:
            raise _Malformed
        self._value_done()

    def _open_string(self, kind: str) -> None:
        self._string = kind
        self.out.append('"')

    def _string_char(self, c: str) -> None:
        if self._escape:
            self._escape += c
            self._decode_escape()
        elif c == "\\":
            self._escape = c
        elif c == '"':
            self.out.append('"')
            kind, self._string = self._string, None
            if kind == "key":
                self._expect = "colon"
            else:
                self._value_done()
        elif c < " ":
            raise _Malformed  # json.loads refuses raw control characters inside strings
        else:
            self.out.append(c)  # json.dumps(ensure_ascii=False) writes every other character as is

    def _decode_escape(self) -> None:
        """Write an escape once complete; a high surrogate waits for the low one json.loads joins it with."""
        e = self._escape
        if e[1] != "u":
            if e[1] not in _ESCAPES:
                raise _Malformed
            self._escape = ""
            self._write_char(_ESCAPES[e[1]])
            return
        if len(e) <= 6:
            if len(e) > 2 and e[-1] not in _HEX:
                raise _Malformed
            if len(e) < 6:
                return
        code = int(e[2:6], 16)
        if not 0xD800 <= code < 0xDC00:
            self._escape = ""
            self._write_char(chr(code))
            return
        tail = e[6:]
        if tail in ("", "\\"):
            return
        if not tail.startswith("\\u"):  # a lone high surrogate; what follows is read afresh
            self._escape = ""
            self._write_char(chr(code))
            for c in tail:
                self._string_char(c)
            return
        if len(tail) > 2 and tail[-1] not in _HEX:
            raise _Malformed
        if len(tail) < 6:
            return
        low = int(tail[2:6], 16)
        if 0xDC00 <= low < 0xE000:
            self._escape = ""
            self._write_char(chr(0x10000 + ((code - 0xD800) << 10) + (low - 0xDC00)))
        else:  # lone high surrogate, then an escape of its own (perhaps another high surrogate)
            self._escape = tail
            self._write_char(chr(code))
            self._decode_escape()

    def _write_char(self, char: str) -> None:
        self.out.append(json.dumps(char, ensure_ascii=False)[1:-1])


def _normal_number(text: str) -> str:
    try:
        value = json.loads(text)
    except ValueError:  # an integer longer than Python converts from text: keep the digits
        return text
    if isinstance(value, float) and not math.isfinite(value):
        return text  # 1e999 would become Infinity, which is not JSON
    return json.dumps(value)


class _CallReader:
    """One call object, {"name": "f", "arguments": {...}} ("parameters" too), a character at a time.

    `name` is set when its string closes, `args_started` at the arguments' opening brace, and the
    arguments' text collects as it arrives (take_args), so a stream can send the call's header as
    soon as both are known and its arguments as they come. Other keys are read and ignored; an
    object without a string name and an object of arguments is _Malformed at its closing brace.
    """

    def __init__(self):
        self.name: str | None = None
        self.args_started = False
        self.done = False
        self._args: list[str] = []
        self._state = "open"  # open | first_key | key | colon | value | after
        self._key = ""
        self._part: _JsonWriter | None = None  # the key or value being read
        self._role = "other"  # what the value being read is: name | args | other

    def take_args(self) -> str:
        text = "".join(self._args)
        self._args.clear()
        return text

    def feed(self, c: str) -> None:
        if self._part is not None:
            if self._feed_part(c):
                return
            self._end_part()  # a number or literal ended just before c
        if c in _WS:
            return
        state = self._state
        if state == "open":
            self._expect(c, "{")
            self._state = "first_key"
        elif state in ("first_key", "key"):
            self._expect(c, '"')
            self._begin_part(c)
        elif state == "colon":
            self._expect(c, ":")
            self._state = "value"
        elif state == "value":
            self._role = self._role_of_value(c)
            self._begin_part(c)
        elif c == ",":  # state "after"
            self._state = "key"
        else:
            self._expect(c, "}")
            if self.name is None or not self.args_started:
                raise _Malformed
            self.done = True

    @staticmethod
    def _expect(c: str, wanted: str) -> None:
        if c != wanted:
            raise _Malformed

    def _role_of_value(self, c: str) -> str:
        if self._key == "name" and self.name is None:
            self._expect(c, '"')
            return "name"
        if self._key in ARGUMENT_KEYS and not self.args_started:
            self._expect(c, "{")
            self.args_started = True
            return "args"
        return "other"  # a key we do not use, or a repeat: read (it must be JSON) and dropped

    def _begin_part(self, c: str) -> None:
        self._part = _JsonWriter()
        self._feed_part(c)

    def _feed_part(self, c: str) -> bool:
        if not self._part.feed(c):
            return False
        if self._state == "value" and self._role == "args":
            self._args.append(self._part.take())
        if self._part.done:
            self._end_part()
        return True

    def _end_part(self) -> None:
        text = self._part.take()
        self._part = None
        if self._state != "value":  # a key
            self._key = json.loads(text)
            self._state = "colon"
            return
        if self._role == "name":
            self.name = json.loads(text)
            if not self.name:
                raise _Malformed
        self._role = "other"
        self._state = "after"


# ---------------------------------------------------------------- streams: text deltas in, chat deltas out

class ToolStream:
    """Text deltas in (feed, then end once), OpenAI chat deltas out; tool_calls: the calls so far.

    Content that may yet be tool-call syntax is held back until decided, and so is a trailing run
    of whitespace (dropped if a call follows it or the output ends with calls). A call's header
    goes out once its name is known and its arguments have begun, then argument fragments as
    they arrive. A block that turns out malformed before its header went out is content after
    all, as is everything after it (parse() says the whole output is content). After a header,
    nothing can be taken back: the rest is content and `malformed` is set, where parse() would
    call the whole output content; that only happens to text that breaks the format mid-call
    (or stops mid-call at max_tokens).
    """

    marker = ""  # the text that opens tool-call syntax inside content

    def __init__(self):
        self.tool_calls: list[ToolCall] = []
        self.malformed = False
        self._deltas: list[dict] = []
        self._mode = "content"  # content | content_only | block
        self._state = ""  # where in a block (each format's own states)
        self._pending = ""  # content that may be the start of the marker
        self._ws = ""  # trailing whitespace of the content so far
        self._held = ""  # raw text of the block not yet sent as anything
        self._reader: _CallReader | None = None
        self._index: int | None = None  # the current call's index once its header went out

    # -- the interface

    def feed(self, text: str) -> list[dict]:
        i = 0
        while i < len(text):
            if self._mode == "content":
                i = self._scan_content(text, i)
            elif self._mode == "content_only":
                self._content(text[i:])
                break
            else:
                self._block_char(text[i])
                i += 1
        return self._take()

    def end(self) -> list[dict]:
        if self._mode == "block" and not self._can_end():
            self._end_mid_block()
        self._content(self._pending)
        self._pending = ""
        if not self.tool_calls and self._ws:  # an output without calls keeps its text exactly
            self._send_content(self._ws)
        self._ws = ""
        return self._take()

    # -- content

    def _scan_content(self, text: str, i: int) -> int:
        """Send the content up to the marker (or up to a possible start of one); return where to go on."""
        buffer = self._pending + text[i:]
        at = buffer.find(self.marker) if self.marker else -1
        if at < 0:
            keep = _marker_prefix_length(buffer, self.marker)
            self._content(buffer[:len(buffer) - keep])
            self._pending = buffer[len(buffer) - keep:]
            return len(text)
        self._content(buffer[:at])
        consumed = at + len(self.marker) - len(self._pending)
        self._pending = ""
        self._open_block()
        return i + consumed

    def _content(self, text: str) -> None:
        body = text.rstrip(_WS)
        if body:
            self._send_content(self._ws + body)
            self._ws = text[len(body):]
        else:
            self._ws += text

    # -- blocks

    def _open_block(self) -> None:
        # The whitespace before a block goes with it: dropped if it is a call, content if not.
        self._held = self._ws + self.marker
        self._ws = ""
        self._mode = "block"

    def _block_char(self, c: str) -> None:
        self._held += c
        try:
            self._block_structure(c)
        except _Malformed:
            self._give_up(malformed=True)

    def _block_structure(self, c: str) -> None:
        raise NotImplementedError

    def _can_end(self) -> bool:
        """Whether the output may end here with the block complete."""
        return False

    def _end_mid_block(self) -> None:
        if self._index is None:
            self._give_up(malformed=True)
        else:
            self.malformed = True  # cut off mid-call: its arguments are incomplete

    def _give_up(self, *, malformed: bool) -> None:
        """What was held is content after all, and so is the rest of the output."""
        self.malformed = self.malformed or malformed
        held, self._held = self._held, ""
        self._mode = "content_only"
        self._reader = None
        self._content(held)

    def _start_call(self) -> None:
        self._reader = _CallReader()
        self._index = None

    def _call_char(self, c: str) -> bool:
        """Feed the current call; send its header, then its arguments, as they become known. True when done."""
        reader = self._reader
        reader.feed(c)
        if self._index is None and reader.name is not None and reader.args_started:
            self._index = self._send_header(reader.name)
        if self._index is not None:
            self._send_arguments(self._index, reader.take_args())
            self._held = ""  # the call's text is sent (as a call), not content
        return reader.done

    # -- deltas (consecutive fragments of one kind are merged within one feed)

    def _send_content(self, text: str) -> None:
        if not text:
            return
        if self._deltas and "content" in self._deltas[-1]:
            self._deltas[-1]["content"] += text
        else:
            self._deltas.append({"content": text})

    def _send_header(self, name: str) -> int:
        index = len(self.tool_calls)
        call = ToolCall(new_call_id(), name, "")
        self.tool_calls.append(call)
        self._deltas.append({"tool_calls": [{"index": index, "id": call.id, "type": "function",
                                             "function": {"name": name, "arguments": ""}}]})
        return index

    def _send_arguments(self, index: int, text: str) -> None:
        if not text:
            return
        self.tool_calls[index].arguments += text
        last = self._deltas[-1]["tool_calls"][0] if self._deltas and "tool_calls" in self._deltas[-1] else None
        if last is not None and last["index"] == index and "id" not in last:
            last["function"]["arguments"] += text
        else:
            self._deltas.append({"tool_calls": [{"index": index, "function": {"arguments": text}}]})

    def _take(self) -> list[dict]:
        deltas, self._deltas = self._deltas, []
        return deltas


def _marker_prefix_length(text: str, marker: str) -> int:
    """The length of the longest end of text that could be the start of marker."""
    for length in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:length]):
            return length
    return 0


class _HermesStream(ToolStream):
    marker = "<tool_call>"
    end_tag = "</tool_call>"

    def _open_block(self) -> None:
        super()._open_block()
        self._state = "call"
        self._start_call()

    def _block_structure(self, c: str) -> None:
        if self._state == "call":
            if self._call_char(c):
                self._state = "after"
        elif self._state == "after":  # between a call's object and </tool_call>
            if c in _WS:
                return
            if c == "{":  # some models put several objects in one block
                self._start_call()
                self._state = "call"
                self._call_char(c)
            elif c == "<":
                self._state = "<"
            else:
                raise _Malformed
        else:  # the end tag so far is in _state
            self._state += c
            if not self.end_tag.startswith(self._state):
                raise _Malformed
            if self._state == self.end_tag:
                self._mode, self._held, self._reader, self._index = "content", "", None, None

    def _can_end(self) -> bool:
        # A last block may stop without (all of) its end tag: the model's EOS came first.
        return self._state != "call"


class _ArrayStream(ToolStream):
    """A JSON array of call objects; what follows its closing bracket is content."""

    def _open_block(self) -> None:
        super()._open_block()
        self._state = "open"

    def _block_structure(self, c: str) -> None:
        if self._state == "open":
            if c in _WS:
                return
            if c != "[":
                raise _Malformed
            self._state = "item"
            self._start_call()
        elif self._state == "item":
            if self._call_char(c):
                self._state = "between"
        elif c in _WS:
            return
        elif c == ",":
            self._state = "item"
            self._start_call()
        elif c == "]":
            self._mode, self._held, self._reader = "content_only", "", None
        else:
            raise _Malformed

    def _can_end(self) -> bool:
        return self._state == "between"  # a missing "]" after complete calls is forgiven


class _MistralStream(_ArrayStream):
    marker = "[TOOL_CALLS]"


class _Llama3Stream(ToolStream):
    python_tag = "<|python_tag|>"

    def __init__(self):
        super().__init__()
        self._mode, self._state = "block", "start"  # undecided until the first character that counts

    def _block_structure(self, c: str) -> None:
        if self._state == "start":
            self._decide_start()
        elif self._state == "call":
            if self._call_char(c):
                self._state = "between"
        elif c in _WS:
            return
        elif self._state == "between" and c == ";":
            self._state = "next"
        elif self._state == "next" and c == "{":
            self._state = "call"
            self._start_call()
            self._call_char(c)
        else:  # text after the calls is content
            self._give_up(malformed=False)

    def _decide_start(self) -> None:
        head = self._held.lstrip(_WS)
        if head.startswith(self.python_tag):
            head = head[len(self.python_tag):].lstrip(_WS)
        elif self.python_tag.startswith(head):
            return  # nothing yet, or part of the tag
        if not head:
            return
        if head != "{":
            self._give_up(malformed=False)  # not JSON: the whole output is content
            return
        self._state = "call"
        self._start_call()
        self._call_char("{")

    def _can_end(self) -> bool:
        return self._state in ("between", "next")


# ---------------------------------------------------------------- parsers

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
    stream_class = _HermesStream


class Llama3JsonParser(ToolParser):
    name = "llama3_json"
    stream_class = _Llama3Stream


class MistralParser(ToolParser):
    name = "mistral"
    stream_class = _MistralStream


PARSERS: dict[str, type[ToolParser]] = {"hermes": HermesParser, "llama3_json": Llama3JsonParser,
                                        "mistral": MistralParser}


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


# ---------------------------------------------------------------- forced choices: the engine's grammar

def forced_name(tool_choice) -> str | None:
    """The function a named tool_choice forces, else None."""
    if isinstance(tool_choice, dict):
        return tool_choice["function"]["name"]
    return None


def forced_spec(tools: list[dict], tool_choice, parallel_tool_calls: bool = True) -> dict | None:
    """The structured_outputs spec that makes the model write the forced call(s), or None."""
    name = forced_name(tool_choice)
    if name is not None:
        return {"json": _parameters(next(t for t in tools if t["function"]["name"] == name))}
    if tool_choice != "required":
        return None
    # vLLM's shape: an array of {"name", "parameters"} objects, one alternative per tool.
    items = {"anyOf": [{"type": "object",
                        "properties": {"name": {"const": tool["function"]["name"]}, "parameters": _parameters(tool)},
                        "required": ["name", "parameters"], "additionalProperties": False}
                       for tool in tools]}
    schema = {"type": "array", "minItems": 1, "items": items}
    if parallel_tool_calls is False:
        schema["maxItems"] = 1
    return {"json": schema}


def _parameters(tool: dict) -> dict:
    return tool["function"].get("parameters") or {"type": "object"}


class _NamedStream(ToolStream):
    """A named tool_choice: the whole output is that function's arguments (the grammar sees to it)."""

    def __init__(self, name: str):
        super().__init__()
        self._name = name
        self._writer = _JsonWriter()

    def feed(self, text: str) -> list[dict]:
        self._header()
        try:
            for c in text:
                self._writer.feed(c)
        except _Malformed:  # not possible under the grammar; what was read stands
            self.malformed = True
            self._writer.done = True
        self._send_arguments(0, self._writer.take())
        return self._take()

    def end(self) -> list[dict]:
        self._header()
        try:
            self._writer.finish()
        except _Malformed:
            self.malformed = True
        self._send_arguments(0, self._writer.take())
        self.malformed = self.malformed or not self._writer.done  # cut off by max_tokens
        return self._take()

    def _header(self) -> None:
        if not self.tool_calls:
            self._send_header(self._name)


class _RequiredStream(_ArrayStream):
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


# ---------------------------------------------------------------- request validation

_CHOICE_WORDS = ("none", "auto", "required")


def validate_tools(tools, tool_choice, parallel_tool_calls) -> None:
    """InvalidRequest, with OpenAI's param names, for tools/tool_choice/parallel_tool_calls the API refuses."""
    names = _check_tools(tools) if tools is not None else []
    _check_tool_choice(tool_choice, names)
    if parallel_tool_calls is not None and not isinstance(parallel_tool_calls, bool):
        raise InvalidRequest("parallel_tool_calls must be a boolean.", param="parallel_tool_calls")
    _check_forced_schemas(tools or [], tool_choice)


def _check_tools(tools) -> list[str]:
    if not isinstance(tools, list):
        raise InvalidRequest("tools must be an array of function tools.", param="tools")
    names: list[str] = []
    for i, tool in enumerate(tools):
        name = _check_tool(tool, f"tools[{i}]")
        if name in names:
            raise InvalidRequest(f"Duplicate function name {name!r} in tools.", param=f"tools[{i}].function.name")
        names.append(name)
    return names


def _check_tool(tool, param: str) -> str:
    if not isinstance(tool, dict) or tool.get("type") != "function":
        raise InvalidRequest('Each tool must be {"type": "function", "function": {...}}.', param=f"{param}.type")
    function = tool.get("function")
    if not isinstance(function, dict):
        raise InvalidRequest("A function tool needs a function object.", param=f"{param}.function")
    name = function.get("name")
    if not isinstance(name, str) or not FUNCTION_NAME.match(name):
        raise InvalidRequest("Function names are 1 to 64 letters, digits, underscores or dashes.",
                             param=f"{param}.function.name")
    for key, kind, wanted in (("description", str, "a string"), ("parameters", dict, "a JSON schema object"),
                              ("strict", bool, "a boolean")):
        if key in function and function[key] is not None and not isinstance(function[key], kind):
            raise InvalidRequest(f"function.{key} must be {wanted}.", param=f"{param}.function.{key}")
    return name


def _check_tool_choice(tool_choice, names: list[str]) -> None:
    if tool_choice is None or tool_choice in _CHOICE_WORDS:
        if tool_choice == "required" and not names:
            raise InvalidRequest('tool_choice "required" needs tools.', param="tool_choice")
        return
    function = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    if (not isinstance(tool_choice, dict) or tool_choice.get("type") != "function" or not isinstance(function, dict)
            or not isinstance(function.get("name"), str)):
        raise InvalidRequest('tool_choice must be "none", "auto", "required" or '
                             '{"type": "function", "function": {"name": ...}}.', param="tool_choice")
    if function["name"] not in names:
        raise InvalidRequest(f"tool_choice names function {function['name']!r}, which is not in tools.",
                             param="tool_choice")


def _check_forced_schemas(tools: list[dict], tool_choice) -> None:
    """A forced choice runs the tools' parameter schemas through the grammar: refuse one it cannot compile.

    Under "auto" or "none" no grammar is built, so a schema only the model reads is not checked.
    """
    from inference.structured_output import StructuredOutputs, check_syntax

    name = forced_name(tool_choice)
    if name is None and tool_choice != "required":
        return
    for i, tool in enumerate(tools):
        if name is not None and tool["function"]["name"] != name:
            continue
        try:
            check_syntax(StructuredOutputs(json=_parameters(tool)))
        except (ValueError, TypeError) as exc:
            raise InvalidRequest(f"tools[{i}].function.parameters is not a schema the engine can enforce: {exc}",
                                 param=f"tools[{i}].function.parameters") from None
