"""Engine results and events -> OpenAI response bodies and SSE chunks (chat and text completions).

`call` is an openai_api.calls.ApiCall, `result` a generation.result.Result.
"""

from __future__ import annotations

import json

DONE = b"data: [DONE]\n\n"


def sse(payload: dict) -> bytes:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n".encode()


def usage_body(usage: dict | None) -> dict:
    usage = usage or {}
    prompt, completion = int(usage.get("prompt_tokens", 0)), int(usage.get("completion_tokens", 0))
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": int(usage.get("cached_tokens", 0))},
    }


def _bytes(token: str) -> list[int]:
    return list(token.encode("utf-8", errors="replace"))


def chat_logprobs(entries: list[dict]) -> dict:
    return {
        "content": [
            {
                "token": e["token"],
                "logprob": e["logprob"],
                "bytes": _bytes(e["token"]),
                "top_logprobs": [
                    {"token": t["token"], "logprob": t["logprob"], "bytes": _bytes(t["token"])} for t in e["top"]
                ],
            }
            for e in entries
        ]
    }


def completion_logprobs(entries: list[dict], offset: int = 0) -> dict:
    tokens, offsets = [], []
    for e in entries:
        offsets.append(offset)
        tokens.append(e["token"])
        offset += len(e["token"])
    # An echoed prompt's first token has no logprob: OpenAI writes null for it and its top_logprobs.
    return {
        "tokens": tokens,
        "token_logprobs": [e["logprob"] for e in entries],
        "top_logprobs": [
            None if e["logprob"] is None else {t["token"]: t["logprob"] for t in e["top"]} for e in entries
        ],
        "text_offset": offsets,
    }


def _head(call, object_name: str) -> dict:
    return {"id": call.request_id, "object": object_name, "created": call.created, "model": call.model}


# ---------------------------------------------------------------- whole responses


def response_body(call, result) -> dict:
    return (chat_response if call.kind == "chat" else completion_response)(call, result)


def chat_response(call, result) -> dict:
    choices = [
        {
            "index": c.index,
            **chat_message(call, c.text, c.finish_reason),
            "logprobs": chat_logprobs(c.logprobs) if call.logprobs is not None else None,
        }
        for c in result.choices
    ]
    return {
        **_head(call, "chat.completion"),
        "choices": choices,
        "usage": usage_body(result.usage),
        "system_fingerprint": None,
    }


def chat_message(call, text: str, finish_reason: str | None) -> dict:
    """{"message", "finish_reason"} of one choice: with tools, the text read as tool calls where it is one."""
    if call.tools is None:
        return {"message": {"role": "assistant", "content": text}, "finish_reason": finish_reason}
    parsed = call.tools.parse(text)
    message = {"role": "assistant", "content": parsed.content}
    if parsed.tool_calls:
        message["tool_calls"] = [tool_call.as_openai() for tool_call in parsed.tool_calls]
    return {"message": message, "finish_reason": call.tools.finish_reason(finish_reason, bool(parsed.tool_calls))}


def completion_response(call, result) -> dict:
    choices = []
    for c in result.choices:
        prompt = c.index // call.n  # a batched request's choice p * n + i belongs to prompt p
        prompt_entries = result.prompt_logprobs.get(prompt, []) if call.echo else []
        text, entries = _generated(call, c.text, c.logprobs)
        choices.append(
            {
                "index": c.index,
                "text": (call.prompt_texts[prompt] if call.echo else "") + text,
                "logprobs": completion_logprobs(prompt_entries + entries) if call.logprobs is not None else None,
                "finish_reason": c.finish_reason,
            }
        )
    usage = usage_body(completion_usage(call, result.usage))
    return {**_head(call, "text_completion"), "choices": choices, "usage": usage, "system_fingerprint": None}


def _generated(call, text: str, entries: list[dict]) -> tuple[str, list[dict]]:
    """What a choice shows of the generated tokens: nothing for max_tokens 0 (the engine made one)."""
    return ("", []) if call.echo_only else (text, entries or [])


def completion_usage(call, usage: dict | None) -> dict | None:
    if not call.echo_only or usage is None:
        return usage
    return {**usage, "completion_tokens": 0}


# ---------------------------------------------------------------- streamed chunks


class ChunkWriter:
    """Turns engine events into the endpoint's SSE chunks, keeping per-choice state (role sent, offsets)."""

    def __init__(self, call):
        self.call = call
        self.chat = call.kind == "chat"
        self.role_sent: set[int] = set()
        self.offsets: dict[int, int] = {}
        self.tool_streams = {} if call.tools is None else {i: call.tools.stream() for i in range(call.n)}

    def _chunk(self, choices: list[dict], usage=None) -> bytes:
        body = {
            **_head(self.call, "chat.completion.chunk" if self.chat else "text_completion"),
            "choices": choices,
            "system_fingerprint": None,
        }
        if self.call.include_usage:
            body["usage"] = usage
        return sse(body)

    def start(self) -> list[bytes]:
        """Chat streams open with one role chunk per choice (as OpenAI's do); echo streams with the prompt."""
        if not self.chat:
            # with logprobs the echo waits for the prompt_logprobs event, which carries them
            if not self.call.echo or self.call.logprobs is not None:
                return []
            return [chunk for prompt in range(len(self.call.prompt_texts)) for chunk in self._echo(prompt, [])]
        chunks = []
        for index in range(self.call.n):
            self.role_sent.add(index)
            chunks.append(
                self._chunk(
                    [
                        {
                            "index": index,
                            "delta": {"role": "assistant", "content": ""},
                            "logprobs": None,
                            "finish_reason": None,
                        }
                    ]
                )
            )
        return chunks

    def delta(self, event: dict) -> list[bytes]:
        index, text = event["index"], event.get("text", "")
        logprobs = event.get("logprobs") if self.call.logprobs is not None else None
        if not self.chat:
            text, logprobs = _generated(self.call, text, logprobs)
        finish = event.get("finish_reason")
        if index in self.tool_streams:
            return self._tool_deltas(index, text, logprobs, finish)
        out = []
        if text or logprobs:
            out.append(self._content_chunk(index, text, logprobs))
        if finish:
            out.append(self._finish_chunk(index, finish))
        return out

    def _tool_deltas(self, index: int, text: str, logprobs, finish: str | None) -> list[bytes]:
        """Chat with tools: the parser decides what of the text is content and what is a call's arguments."""
        stream = self.tool_streams[index]
        deltas = stream.feed(text) if text else []
        if finish:
            deltas += stream.end()
        out = [self._delta_chunk(index, delta) for delta in deltas]
        if logprobs:
            out.append(
                self._chunk([{"index": index, "delta": {}, "logprobs": chat_logprobs(logprobs), "finish_reason": None}])
            )
        if finish:
            del self.tool_streams[index]
            out.append(self._finish_chunk(index, self.call.tools.finish_reason(finish, bool(stream.tool_calls))))
        return out

    def _delta_chunk(self, index: int, delta: dict) -> bytes:
        return self._chunk([{"index": index, "delta": delta, "logprobs": None, "finish_reason": None}])

    def prompt_logprobs(self, event: dict) -> list[bytes]:
        if not self.call.echo or self.call.logprobs is None:
            return []
        return self._echo(event.get("prompt_index", 0), event["logprobs"])

    def _echo(self, prompt: int, prompt_entries: list[dict]) -> list[bytes]:
        """The echoed prompt, as the first chunk of each of its n choices."""
        indices = range(prompt * self.call.n, (prompt + 1) * self.call.n)
        chunks = [self._content_chunk(index, self.call.prompt_texts[prompt], prompt_entries) for index in indices]
        if prompt_entries:  # text_offset counts token strings (as vLLM's), and the BOS has one the text lacks
            self.offsets.update(dict.fromkeys(indices, sum(len(e["token"]) for e in prompt_entries)))
        return chunks

    def _content_chunk(self, index: int, text: str, logprobs) -> bytes:
        if self.chat:
            return self._chunk(
                [
                    {
                        "index": index,
                        "delta": {"content": text},
                        "logprobs": chat_logprobs(logprobs) if logprobs else None,
                        "finish_reason": None,
                    }
                ]
            )
        offset = self.offsets.get(index, 0)
        self.offsets[index] = offset + len(text)
        return self._chunk(
            [
                {
                    "index": index,
                    "text": text,
                    "logprobs": completion_logprobs(logprobs, offset) if logprobs else None,
                    "finish_reason": None,
                }
            ]
        )

    def _finish_chunk(self, index: int, reason: str) -> bytes:
        if self.chat:
            return self._chunk([{"index": index, "delta": {}, "logprobs": None, "finish_reason": reason}])
        return self._chunk([{"index": index, "text": "", "logprobs": None, "finish_reason": reason}])

    def finish(self, event: dict, finished: set[int]) -> list[bytes]:
        """Finish chunks for choices the deltas did not close (aborts), then the usage chunk."""
        out = []
        for index, reason in enumerate(event.get("finish_reasons") or []):
            if index not in finished and reason:
                out += (
                    self._tool_deltas(index, "", None, reason)
                    if index in self.tool_streams
                    else [self._finish_chunk(index, reason)]
                )
        if self.call.include_usage:
            usage = event.get("usage") if self.chat else completion_usage(self.call, event.get("usage"))
            out.append(self._chunk([], usage=usage_body(usage)))
        return out
