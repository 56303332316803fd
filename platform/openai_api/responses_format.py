"""Engine results and events -> Responses API objects and their stream of `response.*` events.

`rc` is an openai_api.responses.ResponseCall, `result` a generation.result.Result. A streamed
response is built from its own events (EventWriter.items), so the ids of its items in
response.completed are those the stream announced.
"""

from __future__ import annotations

import json

from .responses import new_item_id

STATUS_OF_ITEMS = {"completed": "completed", "incomplete": "incomplete", "failed": "incomplete"}


def usage_body(usage: dict | None) -> dict:
    usage = usage or {}
    prompt, completion = int(usage.get("prompt_tokens", 0)), int(usage.get("completion_tokens", 0))
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": int(usage.get("cached_tokens", 0))},
        "output_tokens": completion,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt + completion,
    }


def response_object(
    rc,
    *,
    status: str,
    output: list[dict],
    usage: dict | None = None,
    error: dict | None = None,
    incomplete: dict | None = None,
) -> dict:
    data = rc.data
    return {
        "id": rc.id,
        "object": "response",
        "created_at": rc.created_at,
        "status": status,
        "background": False,
        "error": error,
        "incomplete_details": incomplete,
        "instructions": data.get("instructions"),
        "max_output_tokens": data.get("max_output_tokens"),
        "model": rc.call.model,
        "output": output,
        "parallel_tool_calls": rc.parallel,
        "previous_response_id": data.get("previous_response_id"),
        "reasoning": None,
        "store": rc.store,
        "temperature": data.get("temperature"),
        "text": {"format": dict((data.get("text") or {}).get("format") or {"type": "text"})},
        "tool_choice": data.get("tool_choice") or "auto",
        "tools": [dict(t) for t in data.get("tools") or []],
        "top_p": data.get("top_p"),
        "truncation": "disabled",
        "usage": usage,
        "user": data.get("user"),
        "metadata": dict(data.get("metadata") or {}),
    }


def outcome(finish_reason: str | None) -> tuple[str, dict | None]:
    """(status, incomplete_details) of a finished generation."""
    if finish_reason == "length":
        return "incomplete", {"reason": "max_output_tokens"}
    return "completed", None


def failure_body(error) -> dict:
    """A response's `error` for an engine failure (errors.ServiceError)."""
    return {"code": error.code, "message": error.message}


# ---------------------------------------------------------------- output items


def message_item(text: str, status: str = "completed", item_id: str | None = None) -> dict:
    return {
        "id": item_id or new_item_id("msg"),
        "type": "message",
        "status": status,
        "role": "assistant",
        "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}],
    }


def function_call_item(
    call_id: str, name: str, arguments: str, status: str = "completed", item_id: str | None = None
) -> dict:
    return {
        "id": item_id or new_item_id("fc"),
        "type": "function_call",
        "status": status,
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
    }


def output_items(rc, text: str, status: str) -> list[dict]:
    """The generated text as output items: a message for its content, a function_call per tool call."""
    tools = rc.call.tools
    if tools is None:
        return [message_item(text, STATUS_OF_ITEMS[status])]
    parsed = tools.parse(text)
    items = (
        [message_item(parsed.content or "", STATUS_OF_ITEMS[status])] if parsed.content or not parsed.tool_calls else []
    )
    return items + [function_call_item(call.id, call.name, call.arguments) for call in parsed.tool_calls]


def response_body(rc, result) -> dict:
    """The whole response of a finished generation (JSON answer, stored row)."""
    choice = result.choices[0]
    status, incomplete = outcome(choice.finish_reason)
    return response_object(
        rc,
        status=status,
        output=output_items(rc, choice.text, status),
        usage=usage_body(result.usage),
        incomplete=incomplete,
    )


# ---------------------------------------------------------------- the event stream


def sse_event(payload: dict) -> bytes:
    return f"event: {payload['type']}\ndata: {json.dumps(payload, separators=(',', ':'))}\n\n".encode()


class EventWriter:
    """Engine events -> the Responses stream: response.created, response.in_progress, then per output
    item output_item.added, its content (content_part.added + output_text.delta..., or
    function_call_arguments.delta...), their .done events and output_item.done, and last
    response.completed (response.incomplete when cut by max_output_tokens)."""

    def __init__(self, rc):
        self.rc = rc
        self.sequence = 0
        self.items: list[dict] = []
        self.open: dict | None = None  # the item whose content is being streamed
        self.tool_stream = rc.call.tools.stream() if rc.call.tools is not None else None
        self.skipped_calls: set[int] = set()  # parallel_tool_calls false: calls after the first

    def event(self, kind: str, **fields) -> bytes:
        payload = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return sse_event(payload)

    def start(self) -> list[bytes]:
        response = response_object(self.rc, status="in_progress", output=[])
        return [
            self.event("response.created", response=response),
            self.event("response.in_progress", response=response),
        ]

    def delta(self, event: dict) -> list[bytes]:
        text = event.get("text", "")
        if self.tool_stream is None:
            return self._text(text) if text else []
        deltas = self.tool_stream.feed(text) if text else []
        if event.get("finish_reason"):
            deltas += self.tool_stream.end()
        return [chunk for delta in deltas for chunk in self._chat_delta(delta)]

    def _chat_delta(self, delta: dict) -> list[bytes]:
        """A chat delta of the tool-call stream (tool_calls.ToolStream) as Responses events."""
        if "content" in delta:
            return self._text(delta["content"]) if delta["content"] else []
        out = []
        for call in delta["tool_calls"]:
            if call["index"] in self.skipped_calls or (call.get("id") and call["index"] > 0 and not self.rc.parallel):
                self.skipped_calls.add(call["index"])
                continue
            if call.get("id"):
                out += self._close("completed")
                out += self._open(function_call_item(call["id"], call["function"]["name"], "", "in_progress"))
            elif call["function"].get("arguments") and self.open is not None and self.open["type"] == "function_call":
                self.open["arguments"] += call["function"]["arguments"]
                out.append(
                    self.event(
                        "response.function_call_arguments.delta",
                        item_id=self.open["id"],
                        output_index=len(self.items) - 1,
                        delta=call["function"]["arguments"],
                    )
                )
        return out

    def _text(self, text: str) -> list[bytes]:
        out = []
        if self.open is None or self.open["type"] != "message":
            out += self._close("completed")
            out += self._open_message()
        self.open["content"][0]["text"] += text
        out.append(
            self.event(
                "response.output_text.delta",
                item_id=self.open["id"],
                output_index=len(self.items) - 1,
                content_index=0,
                delta=text,
                logprobs=[],
            )
        )
        return out

    def _open_message(self) -> list[bytes]:
        out = self._open(message_item("", "in_progress"))
        out.append(
            self.event(
                "response.content_part.added",
                item_id=self.open["id"],
                output_index=len(self.items) - 1,
                content_index=0,
                part={"type": "output_text", "text": "", "annotations": []},
            )
        )
        return out

    def _open(self, item: dict) -> list[bytes]:
        self.items.append(item)
        self.open = item
        added = {**item, "content": []} if item["type"] == "message" else dict(item)
        return [self.event("response.output_item.added", output_index=len(self.items) - 1, item=added)]

    def _close(self, status: str) -> list[bytes]:
        item, self.open = self.open, None
        if item is None:
            return []
        index, out = len(self.items) - 1, []
        item["status"] = status
        if item["type"] == "message":
            part = item["content"][0]
            out.append(
                self.event(
                    "response.output_text.done",
                    item_id=item["id"],
                    output_index=index,
                    content_index=0,
                    text=part["text"],
                    logprobs=[],
                )
            )
            out.append(
                self.event(
                    "response.content_part.done",
                    item_id=item["id"],
                    output_index=index,
                    content_index=0,
                    part={"type": "output_text", "text": part["text"], "annotations": []},
                )
            )
        else:
            out.append(
                self.event(
                    "response.function_call_arguments.done",
                    item_id=item["id"],
                    output_index=index,
                    name=item["name"],
                    arguments=item["arguments"],
                )
            )
        out.append(self.event("response.output_item.done", output_index=index, item=item))
        return out

    def finish(self, result) -> tuple[dict, list[bytes]]:
        """The closing events and the response object they end with (also what is stored)."""
        status, incomplete = outcome(result.choices[0].finish_reason)
        out = [] if self.items else self._open_message()  # nothing generated: an empty message, as in JSON
        out += self._close(STATUS_OF_ITEMS[status])
        body = response_object(
            self.rc, status=status, output=self.items, usage=usage_body(result.usage), incomplete=incomplete
        )
        out.append(self.event(f"response.{status}", response=body))
        return body, out

    def error(self, error) -> list[bytes]:
        """An engine failure after the stream began: an `error` event, then response.failed."""
        out = [self.event("error", code=error.code, message=error.message, param=error.param)]
        out += self._close("incomplete")
        body = response_object(self.rc, status="failed", output=self.items, error=failure_body(error))
        out.append(self.event("response.failed", response=body))
        return out
