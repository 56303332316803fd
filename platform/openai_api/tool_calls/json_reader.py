"""JSON read a character at a time: one value written back json.dumps-style as it arrives
(JsonWriter), and one call object {"name", "arguments"} (CallReader) built on it."""

from __future__ import annotations

import json
import math
import re

ARGUMENT_KEYS = ("arguments", "parameters")  # hermes/mistral say arguments, llama 3 parameters


class Malformed(Exception):
    """The text stopped being what the format promised."""


WS = " \t\n\r"
_HEX = set("0123456789abcdefABCDEF")
_SCALAR_STARTS = set("-0123456789tfn")
_SCALAR_CHARS = set("0123456789+-.eE") | set("truefalsn")
_NUMBER = re.compile(r"-?(?:0|[1-9]\d*)(?:\.\d+)?(?:[eE][+-]?\d+)?\Z")
_LITERALS = ("true", "false", "null")
_ESCAPES = {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t"}


class JsonWriter:
    """One JSON value read a character at a time, written back json.dumps-style as it arrives.

    Punctuation is written when seen, numbers and literals when they end, string characters as
    soon as their escape is complete: `out` collects the text, take() hands it over. Raises
    Malformed where json.loads would refuse the text (and for NaN/Infinity, which it allows).
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
        if c not in WS:
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
                raise Malformed
        elif expect == "colon":
            if c != ":":
                raise Malformed
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
            raise Malformed

    def _after_value(self, c: str) -> None:
        if c == ",":
            self.out.append(", ")
            self._expect = "key" if self._stack[-1] == "{" else "value"
        elif c == {"{": "}", "[": "]"}[self._stack[-1]]:
            self._close()
        else:
            raise Malformed

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
            raise Malformed
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
            raise Malformed  # json.loads refuses raw control characters inside strings
        else:
            self.out.append(c)  # json.dumps(ensure_ascii=False) writes every other character as is

    def _decode_escape(self) -> None:
        """Write an escape once complete; a high surrogate waits for the low one json.loads joins it with."""
        e = self._escape
        if e[1] != "u":
            if e[1] not in _ESCAPES:
                raise Malformed
            self._escape = ""
            self._write_char(_ESCAPES[e[1]])
            return
        if len(e) <= 6:
            if len(e) > 2 and e[-1] not in _HEX:
                raise Malformed
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
            raise Malformed
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


class CallReader:
    """One call object, {"name": "f", "arguments": {...}} ("parameters" too), a character at a time.

    `name` is set when its string closes, `args_started` at the arguments' opening brace, and the
    arguments' text collects as it arrives (take_args), so a stream can send the call's header as
    soon as both are known and its arguments as they come. Other keys are read and ignored; an
    object without a string name and an object of arguments is Malformed at its closing brace.
    """

    def __init__(self):
        self.name: str | None = None
        self.args_started = False
        self.done = False
        self._args: list[str] = []
        self._state = "open"  # open | first_key | key | colon | value | after
        self._key = ""
        self._part: JsonWriter | None = None  # the key or value being read
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
        if c in WS:
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
                raise Malformed
            self.done = True

    @staticmethod
    def _expect(c: str, wanted: str) -> None:
        if c != wanted:
            raise Malformed

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
        self._part = JsonWriter()
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
                raise Malformed
        self._role = "other"
        self._state = "after"
