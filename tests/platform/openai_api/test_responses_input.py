"""Responses input items -> chat turns, in process: the mapping, and any JSON at all as `input` is
either items or a 400 naming the field (never another exception)."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from errors import InvalidRequest
from openai_api import responses

JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=20,
)
KEYS = st.sampled_from(["type", "role", "content", "call_id", "name", "arguments", "output", "text", "id"])
ITEM_LIKE = st.dictionaries(
    KEYS,
    JSON
    | st.sampled_from(
        ["message", "function_call", "function_call_output", "user", "assistant", "input_text", "reasoning", "{}"]
    ),
    max_size=6,
)


def chat(items: list, instructions: str | None = None) -> list[dict]:
    return responses.chat_messages(instructions, responses.input_items(items, answered=set()))


def test_items_become_chat_turns_and_calls_join_the_assistant_turn():
    items = [
        {"role": "user", "content": "weather?"},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Let me look."}]},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
        {"type": "function_call", "call_id": "call_2", "name": "get_time", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
        {"type": "function_call_output", "call_id": "call_2", "output": [{"type": "input_text", "text": "noon"}]},
    ]
    messages = chat(items, instructions="Be brief.")
    assert messages == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "weather?"},
        {
            "role": "assistant",
            "content": "Let me look.",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                },
                {"id": "call_2", "type": "function", "function": {"name": "get_time", "arguments": "{}"}},
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "call_2", "content": "noon"},
    ]


def test_a_string_is_one_user_message_and_items_get_ids():
    [item] = responses.input_items("hello", answered=set())
    assert item["type"] == "message" and item["role"] == "user" and item["id"].startswith("msg_")
    assert item["content"] == [{"type": "input_text", "text": "hello"}]


def test_a_call_answered_in_an_earlier_response_is_known():
    items = responses.input_items(
        [{"type": "function_call_output", "call_id": "call_9", "output": "x"}], answered={"call_9"}
    )
    assert items[0]["call_id"] == "call_9"


@pytest.mark.parametrize(
    "item, param",
    [
        ({"type": "function_call", "call_id": "c", "name": "f", "arguments": "[1]"}, "input[0].arguments"),
        ({"type": "function_call", "call_id": "c", "name": "", "arguments": "{}"}, "input[0].name"),
        ({"role": "robot", "content": "hi"}, "input[0].role"),
        ({"role": "user", "content": [{"type": "input_text", "text": 3}]}, "input[0].content[0]"),
        ({"role": "user", "content": {"text": "hi"}}, "input[0].content"),
        ({"type": ["message"], "role": "user", "content": "hi"}, "input[0].type"),
        ({"type": "function_call_output", "call_id": "c", "output": 42}, "input[0].output"),
    ],
)
def test_a_bad_item_names_its_field(item, param):
    with pytest.raises(InvalidRequest) as refused:
        responses.input_items([item], answered={"c"})
    assert refused.value.param == param


@pytest.mark.parametrize(
    "chat_param, param",
    [
        ("messages[3].content", "input"),
        ("max_completion_tokens", "max_output_tokens"),
        ("response_format", "text.format"),
        ("tools[1].function.parameters", "tools[1].parameters"),
        ("temperature", "temperature"),
        (None, None),
    ],
)
def test_chat_fields_are_renamed_to_the_responses_fields(chat_param, param):
    assert responses.responses_param(chat_param) == param


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(st.lists(ITEM_LIKE | JSON, min_size=1, max_size=4))
def test_any_json_input_is_items_or_a_400(value):
    try:
        messages = chat(value)
    except InvalidRequest as refused:
        assert refused.param and refused.param.startswith("input[")
        return
    assert all(m["role"] in ("user", "system", "developer", "assistant", "tool") for m in messages)


@settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(
    st.dictionaries(
        st.sampled_from(["type", "name", "parameters"]),
        JSON | st.sampled_from(["function", "web_search", "mcp"]),
        max_size=3,
    ),
    JSON | st.sampled_from(["auto", "none"]),
)
def test_any_tool_or_tool_choice_is_a_chat_tool_or_a_400(tool, choice):
    try:
        responses.chat_tool(tool, "tools[0]")
        responses.chat_tool_choice(choice)
    except InvalidRequest as refused:
        assert refused.param in ("tools[0].type", "tool_choice")
