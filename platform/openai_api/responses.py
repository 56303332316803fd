"""The Responses API (POST /v1/responses) as a chat generation: a body -> a ResponseCall.

A Responses request is a chat completion in other words: its input items become chat messages
(a function_call item an assistant turn's tool call, a function_call_output item a tool message),
`text.format` becomes response_format, function tools the chat tools. calls.build_call then
validates, tokenizes and builds the engine request exactly as /v1/chat/completions does, so
structured outputs, the tool-call parsers, quotas and usage are the same code. Errors it raises
name the chat field; responses_param() renames them to the Responses field the client sent.
"""

from __future__ import annotations

import json
import logging
import secrets
import time
from dataclasses import dataclass, field

from errors import InvalidRequest, NotFound, ServiceError

from . import calls
from .models import new_response_id
from .responses_serializers import NEUTRAL_VALUES, UNSUPPORTED_FIELDS, ResponseCreateRequestSerializer
from .responses_store import stored_response

log = logging.getLogger("tessera.api")

ENDPOINT = "/v1/responses"
MESSAGE_ROLES = ("user", "system", "developer", "assistant")
TEXT_PARTS = {"input_text", "output_text"}  # refusal parts of a replayed assistant turn are text too
UNSUPPORTED_PARTS = {"input_image": "image input", "input_file": "file input", "input_audio": "audio input"}
# Item types of the Responses API that need what Tessera does not have (built-in tools, reasoning).
UNSUPPORTED_ITEMS = {
    "reasoning": "reasoning items are not supported: the served models do not reason",
    "item_reference": "item references are not supported; use previous_response_id",
    **{
        kind: "built-in tools are not supported, only function tools"
        for kind in (
            "web_search_call",
            "file_search_call",
            "computer_call",
            "computer_call_output",
            "image_generation_call",
            "code_interpreter_call",
            "local_shell_call",
            "local_shell_call_output",
            "mcp_call",
            "mcp_list_tools",
            "mcp_approval_request",
            "mcp_approval_response",
            "custom_tool_call",
            "custom_tool_call_output",
        )
    },
}
BUILT_IN_TOOLS = {
    "web_search",
    "web_search_preview",
    "web_search_preview_2025_03_11",
    "file_search",
    "computer_use_preview",
    "computer_use",
    "code_interpreter",
    "image_generation",
    "mcp",
    "local_shell",
    "custom",
    "shell",
    "apply_patch",
}


@dataclass
class ResponseCall:
    """One /v1/responses generation: the chat ApiCall that runs it and what its response object shows."""

    call: calls.ApiCall
    data: dict  # the validated request fields
    conversation: list[dict]  # the input items before the output: the previous response's, then this input
    created_at: int = field(default_factory=lambda: int(time.time()))

    @property
    def id(self) -> str:
        return self.call.request_id

    @property
    def store(self) -> bool:
        return self.data.get("store") is not False

    @property
    def stream(self) -> bool:
        return self.call.stream

    @property
    def parallel(self) -> bool:
        return self.data.get("parallel_tool_calls") is not False


def build(*, body: dict, user, api_key=None, plan=None) -> ResponseCall:
    """Validate the body and build its generation (errors.ServiceError, naming Responses fields)."""
    check_unsupported(body)
    data = calls.validate(ResponseCreateRequestSerializer, body)
    history = previous_conversation(user, data.get("previous_response_id"))
    new_items = input_items(data["input"], answered=called_ids(history))
    conversation = history + new_items
    chat_body = chat_request(data, conversation)
    try:
        call = calls.build_call(
            kind="chat",
            body=chat_body,
            user=user,
            api_key=api_key,
            plan=plan,
            endpoint=ENDPOINT,
            request_id=new_response_id(),
        )
    except ServiceError as exc:
        exc.param = responses_param(exc.param)
        raise
    return ResponseCall(call=call, data=data, conversation=conversation)


def check_unsupported(body: dict) -> None:
    for name, why in UNSUPPORTED_FIELDS.items():
        if body.get(name) is not None and body[name] not in NEUTRAL_VALUES.get(name, []):
            raise InvalidRequest(f"'{name}' is not supported: {why}.", param=name, code="unsupported_parameter")


def previous_conversation(user, response_id: str | None) -> list[dict]:
    """The stored conversation a follow-up continues: the earlier input items and that response's output."""
    if not response_id:
        return []
    previous = stored_response(user=user, response_id=response_id)
    if previous is None:
        raise NotFound(
            f"Previous response with id '{response_id}' not found.",
            param="previous_response_id",
            code="previous_response_not_found",
        )
    return previous.conversation + previous.body.get("output", [])


# ---------------------------------------------------------------- input items


def new_item_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(24)}"


def input_items(value, *, answered: set[str]) -> list[dict]:
    """The input as Responses items, each checked (param input[i]...); a string is one user message."""
    if isinstance(value, str):
        return [message_item("user", [{"type": "input_text", "text": value}])]
    items = []
    for i, item in enumerate(value):
        items.append(input_item(item, f"input[{i}]"))
        if items[-1]["type"] == "function_call":
            answered.add(items[-1]["call_id"])
        elif items[-1]["type"] == "function_call_output" and items[-1]["call_id"] not in answered:
            raise InvalidRequest(
                f"No tool call found for function call output with call_id '{items[-1]['call_id']}'.",
                param=f"input[{i}].call_id",
            )
    return items


def called_ids(conversation: list[dict]) -> set[str]:
    return {item["call_id"] for item in conversation if item.get("type") == "function_call"}


def input_item(item, param: str) -> dict:
    if not isinstance(item, dict):
        raise InvalidRequest(f"Invalid value for '{param}': an input item must be an object.", param=param)
    kind = _kind(item, "message" if "role" in item else None)
    if kind == "message":
        return message_input(item, param)
    if kind == "function_call":
        return function_call_input(item, param)
    if kind == "function_call_output":
        return function_call_output_input(item, param)
    if kind in UNSUPPORTED_ITEMS:
        raise InvalidRequest(
            f"Input items of type '{kind}' are not supported: {UNSUPPORTED_ITEMS[kind]}.",
            param=f"{param}.type",
            code="unsupported_parameter",
        )
    given = json.dumps(item.get("type"))[:40]
    raise InvalidRequest(
        f"Invalid value for '{param}.type': {given} is not an input item type (message, "
        "function_call, function_call_output).",
        param=f"{param}.type",
    )


def message_item(role: str, content: list[dict], item_id: str | None = None) -> dict:
    return {"type": "message", "id": item_id or new_item_id("msg"), "role": role, "content": content}


def message_input(item: dict, param: str) -> dict:
    role = item.get("role")
    if role not in MESSAGE_ROLES:
        raise InvalidRequest(
            f"Invalid value for '{param}.role': must be one of {', '.join(MESSAGE_ROLES)}.", param=f"{param}.role"
        )
    content = item.get("content")
    if isinstance(content, str):
        return message_item(
            role, [{"type": "output_text" if role == "assistant" else "input_text", "text": content}], _given_id(item)
        )
    if not isinstance(content, list):
        raise InvalidRequest(
            f"Invalid value for '{param}.content': must be a string or a list of content parts.",
            param=f"{param}.content",
        )
    return message_item(
        role, [content_part(part, f"{param}.content[{j}]") for j, part in enumerate(content)], _given_id(item)
    )


def content_part(part, param: str) -> dict:
    kind = _kind(part)
    if kind in UNSUPPORTED_PARTS:
        raise InvalidRequest(
            f"Content parts of type '{kind}' are not supported: {UNSUPPORTED_PARTS[kind]} needs a multimodal model.",
            param=f"{param}.type",
            code="unsupported_parameter",
        )
    if kind == "refusal" and isinstance(part.get("refusal"), str):
        return {"type": "output_text", "text": part["refusal"]}
    if kind not in TEXT_PARTS or not isinstance(part.get("text"), str):
        raise InvalidRequest(
            f'Invalid value for \'{param}\': a content part is {{"type": "input_text" or '
            '"output_text", "text": string}.',
            param=param,
        )
    return {"type": kind, "text": part["text"]}


def function_call_input(item: dict, param: str) -> dict:
    for name in ("call_id", "name", "arguments"):
        if not isinstance(item.get(name), str) or (name != "arguments" and not item[name]):
            raise InvalidRequest(
                f"Invalid value for '{param}.{name}': must be a non-empty string.", param=f"{param}.{name}"
            )
    try:
        arguments = json.loads(item["arguments"]) if item["arguments"].strip() else {}
    except ValueError:
        arguments = None
    if not isinstance(arguments, dict):
        raise InvalidRequest(
            f"Invalid value for '{param}.arguments': must be a JSON object, as text.", param=f"{param}.arguments"
        )
    return {
        "type": "function_call",
        "id": _given_id(item) or new_item_id("fc"),
        "call_id": item["call_id"],
        "name": item["name"],
        "arguments": item["arguments"],
        "status": "completed",
    }


def function_call_output_input(item: dict, param: str) -> dict:
    if not isinstance(item.get("call_id"), str) or not item["call_id"]:
        raise InvalidRequest(
            f"Invalid value for '{param}.call_id': must be a non-empty string.", param=f"{param}.call_id"
        )
    output = item.get("output")
    if isinstance(output, list):  # a list of input_text parts
        output = "\n".join(content_part(part, f"{param}.output[{j}]")["text"] for j, part in enumerate(output))
    if not isinstance(output, str):
        raise InvalidRequest(
            f"Invalid value for '{param}.output': must be a string or a list of input_text parts.",
            param=f"{param}.output",
        )
    return {
        "type": "function_call_output",
        "id": _given_id(item) or new_item_id("fco"),
        "call_id": item["call_id"],
        "output": output,
        "status": "completed",
    }


def _kind(value, default: str | None = None) -> str | None:
    """An object's "type" when it is a string (anything else is no type: a 400, never a lookup error)."""
    if not isinstance(value, dict):
        return None
    kind = value.get("type", default)
    return kind if isinstance(kind, str) else None


def _given_id(item: dict) -> str | None:
    return item["id"] if isinstance(item.get("id"), str) and item["id"] else None


# ---------------------------------------------------------------- the chat request


def chat_request(data: dict, conversation: list[dict]) -> dict:
    """The /v1/chat/completions body that generates this response."""
    body = {
        "model": data["model"],
        "messages": chat_messages(data.get("instructions"), conversation),
        "stream": data.get("stream", False),
    }
    for name in ("temperature", "top_p", "user", "seed"):
        if data.get(name) is not None:
            body[name] = data[name]
    if data.get("max_output_tokens") is not None:
        body["max_completion_tokens"] = data["max_output_tokens"]
    text_format = (data.get("text") or {}).get("format")
    if text_format:
        body["response_format"] = response_format(text_format)
    if data.get("tools"):
        body["tools"] = [chat_tool(tool, f"tools[{i}]") for i, tool in enumerate(data["tools"])]
    if data.get("tool_choice") is not None:
        body["tool_choice"] = chat_tool_choice(data["tool_choice"])
    body["parallel_tool_calls"] = data.get("parallel_tool_calls") is not False
    return body


def chat_messages(instructions: str | None, conversation: list[dict]) -> list[dict]:
    """Items as chat turns: consecutive function calls join the assistant turn before them."""
    messages = [{"role": "system", "content": instructions}] if instructions else []
    for item in conversation:
        if item["type"] == "message":
            messages.append({"role": item["role"], "content": "\n".join(part["text"] for part in item["content"])})
        elif item["type"] == "function_call":
            call = {
                "id": item["call_id"],
                "type": "function",
                "function": {"name": item["name"], "arguments": item["arguments"]},
            }
            if not (messages and messages[-1]["role"] == "assistant"):
                messages.append({"role": "assistant", "content": ""})
            messages[-1].setdefault("tool_calls", []).append(call)
        else:  # function_call_output
            messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": item["output"]})
    return messages


def response_format(text_format: dict) -> dict:
    if text_format["type"] != "json_schema":
        return {"type": text_format["type"]}
    schema = {key: text_format[key] for key in ("name", "description", "schema", "strict") if key in text_format}
    return {"type": "json_schema", "json_schema": schema}


def chat_tool(tool: dict, param: str) -> dict:
    """A Responses function tool ({"type", "name", "parameters"...}) as a chat tool; built-in tools are a 400."""
    kind = _kind(tool)
    if kind in BUILT_IN_TOOLS:
        raise InvalidRequest(
            f"Tools of type '{kind}' are not supported: only function tools, whose calls the client runs.",
            param=f"{param}.type",
            code="unsupported_parameter",
        )
    if kind != "function":
        given = json.dumps(tool.get("type"))[:40]
        raise InvalidRequest(f"Invalid value for '{param}.type': {given} is not a tool type.", param=f"{param}.type")
    function = {key: tool[key] for key in ("name", "description", "parameters") if key in tool}
    return {"type": "function", "function": function}


def chat_tool_choice(choice):
    if _kind(choice) in BUILT_IN_TOOLS:
        raise InvalidRequest(
            f"tool_choice of type '{choice['type']}' is not supported: only function tools.",
            param="tool_choice",
            code="unsupported_parameter",
        )
    if isinstance(choice, dict) and choice.get("type") == "function":
        return {"type": "function", "function": {"name": choice.get("name")}}
    return choice  # "none" / "auto" / "required", or something validate_tools refuses with the right param


def responses_param(param: str | None) -> str | None:
    """The Responses field a chat field came from (calls.build_call names the chat request's)."""
    if not param:
        return param
    if param.startswith("messages"):
        return "input"
    if param.startswith("tools[") and ".function." in param:
        return param.replace(".function.", ".", 1)
    if param.startswith("response_format"):
        return "text.format"
    return {"max_completion_tokens": "max_output_tokens", "max_tokens": "max_output_tokens"}.get(param, param)
