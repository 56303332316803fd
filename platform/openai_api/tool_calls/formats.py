"""The format streams: text deltas in, OpenAI chat deltas out, one class per model format
(ToolStream holds what they share: content, held-back text, headers and argument fragments)."""

from __future__ import annotations

from .json_reader import WS, CallReader, Malformed
from .output import ToolCall, new_call_id


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
        self._reader: CallReader | None = None
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
            self._content(buffer[: len(buffer) - keep])
            self._pending = buffer[len(buffer) - keep :]
            return len(text)
        self._content(buffer[:at])
        consumed = at + len(self.marker) - len(self._pending)
        self._pending = ""
        self._open_block()
        return i + consumed

    def _content(self, text: str) -> None:
        body = text.rstrip(WS)
        if body:
            self._send_content(self._ws + body)
            self._ws = text[len(body) :]
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
        except Malformed:
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
        self._reader = CallReader()
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
        self._deltas.append(
            {
                "tool_calls": [
                    {"index": index, "id": call.id, "type": "function", "function": {"name": name, "arguments": ""}}
                ]
            }
        )
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


class HermesStream(ToolStream):
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
            if c in WS:
                return
            if c == "{":  # some models put several objects in one block
                self._start_call()
                self._state = "call"
                self._call_char(c)
            elif c == "<":
                self._state = "<"
            else:
                raise Malformed
        else:  # the end tag so far is in _state
            self._state += c
            if not self.end_tag.startswith(self._state):
                raise Malformed
            if self._state == self.end_tag:
                self._mode, self._held, self._reader, self._index = "content", "", None, None

    def _can_end(self) -> bool:
        # A last block may stop without (all of) its end tag: the model's EOS came first.
        return self._state != "call"


class ArrayStream(ToolStream):
    """A JSON array of call objects; what follows its closing bracket is content."""

    def _open_block(self) -> None:
        super()._open_block()
        self._state = "open"

    def _block_structure(self, c: str) -> None:
        if self._state == "open":
            if c in WS:
                return
            if c != "[":
                raise Malformed
            self._state = "item"
            self._start_call()
        elif self._state == "item":
            if self._call_char(c):
                self._state = "between"
        elif c in WS:
            return
        elif c == ",":
            self._state = "item"
            self._start_call()
        elif c == "]":
            self._mode, self._held, self._reader = "content_only", "", None
        else:
            raise Malformed

    def _can_end(self) -> bool:
        return self._state == "between"  # a missing "]" after complete calls is forgiven


class MistralStream(ArrayStream):
    marker = "[TOOL_CALLS]"


class Llama3Stream(ToolStream):
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
        elif c in WS:
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
        head = self._held.lstrip(WS)
        if head.startswith(self.python_tag):
            head = head[len(self.python_tag) :].lstrip(WS)
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
