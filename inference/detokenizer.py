"""Incremental detokenization that never emits half a UTF-8 character, plus stop strings.

Each step decodes only a short window of ids (vLLM's prefix/read offsets): the text of the
window without the new tokens is subtracted from the text with them. A window whose text ends
in U+FFFD is an incomplete byte sequence, so nothing is emitted until the next token completes it.

Without stop strings nothing needs the text until someone reads it, so tokens are buffered and
decoded in one window when `text` is read (one decode per read instead of two per token).
"""

from __future__ import annotations

CONTEXT_TOKENS = 5  # prompt tokens decoded alongside the output so leading spaces come out right


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer,
        prompt_token_ids: list[int],
        skip_special_tokens: bool,
        stop_strings: list[str],
        include_stop_str: bool,
    ):
        self.tokenizer = tokenizer
        self.skip_special = skip_special_tokens
        self.ids = list(prompt_token_ids[-CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self._text = ""
        self.pending: list[int] = []
        self.stop_strings = stop_strings
        self.include_stop = include_stop_str
        self.hold_back = max((len(s) for s in stop_strings), default=1) - 1

    def add_token(self, token_id: int, check_stop: bool = True) -> str | None:
        """Append one token; returns the stop string if the text now contains one.

        check_stop=False (before min_tokens) neither looks for nor cuts at stop strings: the
        sequence goes on, so its text must keep them.
        """
        if not self.stop_strings:
            self.pending.append(token_id)
            return None
        new_len = self._consume([token_id])
        return self._check_stop(new_len) if check_stop and new_len else None

    @property
    def text(self) -> str:
        if self.pending:
            pending, self.pending = self.pending, []
            if not self._consume(pending, allow_partial=False):
                for token_id in pending:  # the window ends mid-character: go token by token
                    self._consume([token_id])
        return self._text

    @text.setter
    def text(self, value: str) -> None:
        self._text = value

    def _consume(self, token_ids: list[int], allow_partial: bool = True) -> int:
        """Append tokens and emit the window's new complete text; returns its length (0 if none)."""
        if not allow_partial:
            saved = (len(self.ids), self.prefix_offset, self.read_offset)
        self.ids.extend(token_ids)
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.ids[self.prefix_offset :])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            new_text = full[len(prefix) :]
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            self._text += new_text
            return len(new_text)
        if not allow_partial:
            del self.ids[saved[0] :]
            self.prefix_offset, self.read_offset = saved[1], saved[2]
        return 0

    def _decode(self, ids: list[int]) -> str:
        if not ids:
            return ""
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special, clean_up_tokenization_spaces=False)

    def _check_stop(self, new_len: int) -> str | None:
        if not self.stop_strings:
            return None
        longest = self.hold_back + 1
        search_from = max(0, len(self.text) - new_len - longest + 1)
        for stop in self.stop_strings:
            at = self.text.find(stop, search_from)
            if at != -1:
                self.text = self.text[: at + len(stop)] if self.include_stop else self.text[:at]
                return stop
        return None

    def visible_text(self, finished: bool) -> str:
        """While running, hold back a possible partial stop string so streams never retract text."""
        if finished or self.hold_back == 0:
            return self.text
        return self.text[: max(0, len(self.text) - self.hold_back)]
