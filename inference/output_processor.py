"""The engine's outputs as protocol events (docs/protocol.md): per-request state, deltas, logprobs,
usage and metrics. Pure: no Redis, no threads; the worker sends what this returns (vLLM's
OutputProcessor plays the same part between its engine core and its API server).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from inference import protocol


@dataclass
class RequestState:
    request_id: str
    entry_id: str
    n: int
    stream: str = ""  # the request stream it came from (where it is XACKed)
    prompt_tokens: int = 0
    want_logprobs: int | None = None
    want_prompt_logprobs: int | None = None
    prompt_logprobs_sent: bool = False
    submitted_at: float | None = None
    received_at: float = field(default_factory=time.time)
    first_token_at: float | None = None
    sent_len: list[int] = field(default_factory=list)  # characters of text already sent per choice
    sent_ids: list[int] = field(default_factory=list)  # tokens already sent per choice
    finished: list[bool] = field(default_factory=list)
    finish_reasons: list[str | None] = field(default_factory=list)
    cached_tokens: int = 0
    num_preemptions: int = 0
    ttl_set_at: float = 0.0  # monotonic time of the output stream's last EXPIRE
    written_at: float = float("-inf")  # monotonic time of the last write to its output stream
    lease_id: str | None = None  # the web process's lease (protocol.lease_key); None: not leased

    def __post_init__(self):
        self.sent_len = [0] * self.n
        self.sent_ids = [0] * self.n
        self.finished = [False] * self.n
        self.finish_reasons = [None] * self.n

    @property
    def completion_tokens(self) -> int:
        return sum(self.sent_ids)

    def usage(self) -> protocol.Usage:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "cached_tokens": self.cached_tokens,
        }

    def metrics(self) -> dict:
        now = time.time()
        queue_ms = None if self.submitted_at is None else max(0.0, (self.received_at - self.submitted_at) * 1000)
        ttft_ms = None if self.first_token_at is None else (self.first_token_at - self.received_at) * 1000
        return {
            "queue_ms": queue_ms,
            "ttft_ms": ttft_ms,
            "latency_ms": (now - self.received_at) * 1000,
            "num_preemptions": self.num_preemptions,
        }


class OutputProcessor:
    """Turns each step's RequestOutputs into the events of each request's output stream.

    `tokenizer` names tokens the engine gave no decoded text for (logprob candidates);
    `stream_interval` is how many tokens a running request's deltas carry (the first and the
    last go at once)."""

    def __init__(self, tokenizer, stream_interval: int = 1):
        self.tokenizer = tokenizer
        self.stream_interval = stream_interval

    def events(self, state: RequestState, output) -> list[protocol.Event]:
        """This step's events of one request, in stream order: nothing while its delta is not due;
        a terminal event (finish or error) last once it ended."""
        if getattr(output, "error", None):
            return [protocol.error_event("engine_error", output.error)]
        if getattr(output, "embedding", None) is not None:  # an embedding engine's result: whole, at once
            return self._embedding_events(state, output)
        state.cached_tokens = output.num_cached_tokens or 0
        state.prompt_tokens = len(output.prompt_token_ids) or state.prompt_tokens
        if output.metrics is not None:
            state.num_preemptions = output.metrics.num_preemptions
        if not output.finished and not self._delta_due(state, output.outputs):
            return []
        events: list[protocol.Event] = [e for c in output.outputs if (e := self._delta(state, c)) is not None]
        if (prompt_event := self._prompt_logprobs(state, output)) is not None:
            events.insert(0, prompt_event)
        if output.finished:
            events.append(protocol.finish_event(state.finish_reasons, state.usage(), state.metrics()))
        return events

    @staticmethod
    def _embedding_events(state: RequestState, output) -> list[protocol.Event]:
        state.prompt_tokens = len(output.prompt_token_ids) or state.prompt_tokens
        state.first_token_at = time.time()
        state.finish_reasons = ["stop"]
        return [
            protocol.embedding_event(output.float32_bytes()),
            protocol.finish_event(state.finish_reasons, state.usage(), state.metrics()),
        ]

    @staticmethod
    def abort_event(state: RequestState) -> protocol.FinishEvent:
        """The finish of an aborted request: 'abort' for every choice still running, the usage so far."""
        reasons = [reason or "abort" for reason in state.finish_reasons]
        return protocol.finish_event(reasons, state.usage(), state.metrics())

    def _delta_due(self, state: RequestState, completions) -> bool:
        """With stream_interval k, a running request's tokens go out k at a time (fewer, larger
        deltas: less work per token for Redis and the web tier); the first token never waits."""
        k = self.stream_interval
        if k <= 1 or state.first_token_at is None:
            return True
        return any(
            c.finish_reason is not None or len(c.token_ids) - state.sent_ids[c.index] >= k
            for c in completions
            if c.index < state.n and not state.finished[c.index]
        )

    def _delta(self, state: RequestState, completion) -> protocol.DeltaEvent | None:
        i = completion.index
        if i >= state.n or state.finished[i]:
            return None
        new_ids = completion.token_ids[state.sent_ids[i] :]
        new_text = completion.text[state.sent_len[i] :]
        finished = completion.finish_reason is not None
        if not new_ids and not new_text and not finished:
            return None
        event = protocol.delta_event(i, new_text, list(new_ids), completion.finish_reason, completion.stop_reason)
        if state.want_logprobs is not None and completion.logprobs is not None:
            event["logprobs"] = self._logprobs(
                completion, state.sent_ids[i], len(completion.token_ids), state.want_logprobs
            )
        if new_ids and state.first_token_at is None:
            state.first_token_at = time.time()
        state.sent_ids[i] = len(completion.token_ids)
        state.sent_len[i] = max(state.sent_len[i], len(completion.text))
        state.finished[i] = finished
        state.finish_reasons[i] = completion.finish_reason
        return event

    def _logprobs(self, completion, start: int, end: int, top_n: int) -> list[protocol.LogprobEntry]:
        return [
            self._logprob_entry(completion.token_ids[pos], completion.logprobs[pos], top_n)
            for pos in range(start, min(end, len(completion.logprobs)))
        ]

    def _prompt_logprobs(self, state: RequestState, output) -> protocol.PromptLogprobsEvent | None:
        """The prompt's logprobs, once, as soon as the engine has them for every prompt token."""
        entries, prompt = output.prompt_logprobs, output.prompt_token_ids
        if state.want_prompt_logprobs is None or state.prompt_logprobs_sent or entries is None:
            return None
        if len(entries) < len(prompt):
            return None
        state.prompt_logprobs_sent = True
        first: protocol.LogprobEntry = {
            "token_id": prompt[0],
            "token": self._token_text(prompt[0], None),
            "logprob": None,
            "top": [],
        }
        top_n = state.want_prompt_logprobs
        return protocol.prompt_logprobs_event(
            [first]
            + [
                self._logprob_entry(token_id, candidates, top_n)
                for token_id, candidates in zip(prompt[1:], entries[1:])
            ]
        )

    def _logprob_entry(self, token_id: int, candidates, top_n: int) -> protocol.LogprobEntry:
        candidates = candidates or {}
        chosen = candidates.get(token_id)
        ranked = sorted(candidates.items(), key=lambda kv: kv[1].rank)[:top_n]
        return {
            "token_id": token_id,
            "token": self._token_text(token_id, chosen),
            "logprob": chosen.logprob if chosen is not None else None,
            "top": [{"token_id": tid, "token": self._token_text(tid, lp), "logprob": lp.logprob} for tid, lp in ranked],
        }

    def _token_text(self, token_id: int, logprob) -> str:
        if logprob is not None and logprob.decoded_token is not None:
            return logprob.decoded_token
        return self.tokenizer.decode([token_id])
