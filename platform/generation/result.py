"""The one accumulator of a generation's engine events: every front door folds events into a Result.

Times come from the events' Redis stream entry ids (the time the worker wrote each one), so a
request followed live (SSE, websocket) and one polled coarsely (a batch line) measure the same
thing the same way.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from inference import protocol


@dataclass
class Choice:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: object = None


@dataclass
class Result:
    """Choices, prompt logprobs (or embeddings), usage, the worker's metrics, the error and the times of one
    generation."""

    n: int = 1  # choices expected: a choice that produced nothing still appears
    by_index: dict[int, Choice] = field(default_factory=dict)
    prompt_logprobs: dict[int, list[dict]] = field(default_factory=dict)  # prompt index -> entries
    embeddings: dict[int, dict] = field(default_factory=dict)  # prompt index -> its embedding event
    usage: dict | None = None  # the finish event's prompt/completion/cached tokens
    engine_metrics: dict = field(default_factory=dict)  # queue_ms, ttft_ms (from the worker's acceptance), ...
    error: dict | None = None  # the error event: code, message, param
    first_token_at: float | None = None  # wall-clock seconds the worker wrote the first token
    ended_at: float | None = None  # ... and the terminal event
    tokens_seen: int = 0

    def add(self, event: dict) -> None:
        kind = event["type"]
        if kind == "delta":
            self._add_delta(event)
        elif kind == "prompt_logprobs":
            self.prompt_logprobs[event.get("prompt_index", 0)] = event["logprobs"]
        elif kind == "embedding":  # a whole result at once: its write time is the first "token"'s
            self.embeddings[event.get("prompt_index", 0)] = event
            self.first_token_at = self.first_token_at or written_at(event)
        elif kind == "finish":
            self.usage, self.engine_metrics = event.get("usage"), event.get("metrics") or {}
            for index, reason in enumerate(event.get("finish_reasons") or []):
                choice = self._choice(index)
                choice.finish_reason = choice.finish_reason or reason
        elif kind == "error":
            self.error = {k: v for k, v in event.items() if k not in ("type", "entry_id")}
        if kind in protocol.TERMINAL_EVENTS:
            self.ended_at = written_at(event)

    def _add_delta(self, event: dict) -> None:
        choice = self._choice(event["index"])
        choice.text += event.get("text", "")
        choice.token_ids.extend(event.get("token_ids") or [])
        choice.logprobs.extend(event.get("logprobs") or [])
        if event.get("finish_reason"):
            choice.finish_reason, choice.stop_reason = event["finish_reason"], event.get("stop_reason")
        if event.get("token_ids"):
            self.tokens_seen += len(event["token_ids"])
            if self.first_token_at is None:
                self.first_token_at = written_at(event)

    def _choice(self, index: int) -> Choice:
        return self.by_index.setdefault(index, Choice(index))

    @property
    def ended(self) -> bool:
        return self.ended_at is not None

    @property
    def choices(self) -> list[Choice]:
        for index in range(self.n):
            self._choice(index)
        return [self.by_index[i] for i in sorted(self.by_index)]

    @property
    def text(self) -> str:
        """The first choice's text (the playground asks for one)."""
        return self._choice(0).text

    @property
    def finish_reason(self) -> str:
        return self._choice(0).finish_reason or ""

    @property
    def prompt_tokens(self) -> int | None:
        return (self.usage or {}).get("prompt_tokens")

    @property
    def completion_tokens(self) -> int:
        return (self.usage or {}).get("completion_tokens", self.tokens_seen)

    @property
    def cached_tokens(self) -> int:
        return (self.usage or {}).get("cached_tokens") or 0

    @property
    def was_aborted(self) -> bool:
        return any(c.finish_reason == "abort" for c in self.by_index.values())


def written_at(event: dict) -> float:
    """When the worker wrote the event: its stream entry id is Redis's clock in ms (now, for events
    made up on this side, such as a liveness verdict)."""
    entry_id = event.get("entry_id")
    return int(entry_id.partition("-")[0]) / 1000 if entry_id else time.time()
