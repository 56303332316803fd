"""Tool calling through the whole stack on the real default model (SmolLM2-135M-Instruct), with the
official client and LangChain's ChatOpenAI unchanged: forced choices are enforced by the grammar, so
even a 135M model emits a valid call; streamed argument deltas add up to the call; the tool's
result goes back into the prompt."""

from __future__ import annotations

import json

import openai
import pytest

from tests.platform.live_stack import real_model_stack

pytestmark = pytest.mark.slow
MODEL = "SmolLM2-135M-Instruct"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "The local time in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
NAMED = {"type": "function", "function": {"name": "get_weather"}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    with real_model_stack(tmp_path_factory, "tools-stack", {"max_model_len": 1024, "num_kv_blocks": 256}) as running:
        yield running


@pytest.fixture(scope="module")
def client(live):
    return openai.OpenAI(base_url=live.base_url + "/v1", api_key=live.api_key, max_retries=0, timeout=120)


def check_weather_call(call) -> dict:
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    arguments = json.loads(call.function.arguments)
    assert set(arguments) == {"city", "unit"} and isinstance(arguments["city"], str)
    assert arguments["unit"] in ("celsius", "fahrenheit")
    return arguments


def test_a_named_tool_choice_always_gets_a_valid_call(client):
    for seed in range(4):
        reply = client.chat.completions.create(
            model=MODEL,
            messages=ASK,
            tools=[WEATHER, TIME],
            tool_choice=NAMED,
            temperature=1.0,
            seed=seed,
            max_tokens=60,
        )
        choice = reply.choices[0]
        assert choice.message.content is None and len(choice.message.tool_calls) == 1
        check_weather_call(choice.message.tool_calls[0])
        assert choice.finish_reason == "stop"  # OpenAI's for a named choice


def test_required_gets_calls_of_the_offered_tools_and_parallel_false_gets_one(client):
    reply = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=[WEATHER, TIME], tool_choice="required", temperature=0, max_tokens=120
    )
    calls = reply.choices[0].message.tool_calls
    assert calls and reply.choices[0].finish_reason == "tool_calls"
    assert {c.function.name for c in calls} <= {"get_weather", "get_time"}
    for call in calls:
        assert isinstance(json.loads(call.function.arguments), dict)
    single = client.chat.completions.create(
        model=MODEL,
        messages=ASK,
        tools=[WEATHER, TIME],
        tool_choice="required",
        parallel_tool_calls=False,
        temperature=1.0,
        seed=3,
        max_tokens=120,
    )
    assert len(single.choices[0].message.tool_calls) == 1


@pytest.mark.parametrize("tool_choice", [NAMED, "required"])
def test_streamed_argument_deltas_add_up_to_the_whole_answers_call(client, tool_choice):
    whole = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=[WEATHER], tool_choice=tool_choice, temperature=0, max_tokens=80
    )
    stream = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=[WEATHER], tool_choice=tool_choice, temperature=0, max_tokens=80, stream=True
    )
    names, arguments, ids, finish, content = {}, {}, {}, None, ""
    for chunk in stream:
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        for delta in choice.delta.tool_calls or []:
            if delta.id:
                assert delta.index not in ids, "a call's id comes once, with its first delta"
                ids[delta.index], names[delta.index] = delta.id, delta.function.name
            arguments[delta.index] = arguments.get(delta.index, "") + (delta.function.arguments or "")
        finish = choice.finish_reason or finish
    expected = whole.choices[0].message.tool_calls
    assert content == "" and [names[i] for i in sorted(names)] == [c.function.name for c in expected]
    assert [arguments[i] for i in sorted(arguments)] == [c.function.arguments for c in expected]
    assert finish == whole.choices[0].finish_reason


def test_the_tool_result_goes_back_into_the_prompt(client):
    first = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=[WEATHER], tool_choice=NAMED, temperature=0, max_tokens=60
    )
    call = first.choices[0].message.tool_calls[0]
    follow_up = [
        *ASK,
        first.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "18 degrees and sunny"},
    ]
    answer = client.chat.completions.create(
        model=MODEL, messages=follow_up, tools=[WEATHER], temperature=0, max_tokens=40
    )
    assert answer.choices[0].finish_reason in ("stop", "length", "tool_calls")
    # the prompt grew by the call and its result: the model saw both
    assert answer.usage.prompt_tokens > first.usage.prompt_tokens + 8


def test_bad_tools_are_400s_naming_the_field(client):
    cases = [
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, "tools[0].function.name"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [WEATHER], "tool_choice": NAMED, "response_format": {"type": "json_object"}}, "tool_choice"),
    ]
    for extra, param in cases:
        with pytest.raises(openai.BadRequestError) as caught:
            client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=8, **extra)
        assert caught.value.body["param"] == param, (extra, caught.value.body)


def test_langchain_bind_tools_round_trip(live):
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(
        model=MODEL,
        base_url=live.base_url + "/v1",
        api_key=live.api_key,
        temperature=0,
        max_tokens=60,
        max_retries=0,
        timeout=120,
    )

    def get_weather(city: str, unit: str) -> str:
        """The current weather in a city (unit: celsius or fahrenheit)."""
        return f"18 degrees {unit} and sunny in {city}"

    question = HumanMessage("What is the weather in Paris?")
    for tool_choice in ("get_weather", "required"):  # a named function, then any of the tools
        called = llm.bind_tools([get_weather], tool_choice=tool_choice).invoke([question])
        assert called.tool_calls and all(c["name"] == "get_weather" for c in called.tool_calls), tool_choice
        args = called.tool_calls[0]["args"]
        assert isinstance(args["city"], str) and isinstance(args["unit"], str)
    result = ToolMessage(get_weather(**args), tool_call_id=called.tool_calls[0]["id"])
    answer = llm.bind_tools([get_weather]).invoke([question, called, result])
    assert isinstance(answer.content, str) and answer.response_metadata["finish_reason"] in (
        "stop",
        "length",
        "tool_calls",
    )
