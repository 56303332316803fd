"""The Responses API through the whole stack (web server, engine worker on the tiny model, Redis,
SQLite) with the official openai client: create, stream, structured outputs, function tools,
store / retrieve / delete, previous_response_id (per user), usage recorded once, bad input.

A Responses request is a chat completion in other words, so its greedy answer must equal the
chat completion of the same conversation on the same worker: that is what proves the input items,
instructions and a previous response's turns reached the prompt.
"""

from __future__ import annotations

import json

import openai
import pytest

pytestmark = pytest.mark.slow
MODEL = "tiny-llama"
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The current weather in a city.",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
        "required": ["city"],
        "additionalProperties": False,
    },
}
CHAT_WEATHER = {"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}}
YES_NO = {
    "type": "json_schema",
    "name": "answer",
    "strict": True,
    "schema": {
        "type": "object",
        "properties": {"answer": {"type": "string", "enum": ["yes", "no"]}},
        "required": ["answer"],
        "additionalProperties": False,
    },
}


def chat_text(client, messages: list[dict], **kwargs) -> str:
    reply = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, **kwargs)
    return reply.choices[0].message.content


def usage_rows(live_stack, response_id: str) -> list[tuple]:
    return live_stack.sql(
        "SELECT endpoint, prompt_tokens, completion_tokens, status_code FROM usage_usagerecord WHERE request_id = ?",
        (response_id,),
    )


@pytest.fixture(scope="module")
def other_client(live_stack):
    """A second user's client: their keys see none of the first user's responses."""
    live_stack.manage(
        "shell",
        "-c",
        "from django.contrib.auth.models import User; "
        "User.objects.create_user('other-responses', password='pw-long-enough-2')",
    )
    key = live_stack.manage("create_api_key", "other-responses").strip().splitlines()[-1]
    return openai.OpenAI(base_url=live_stack.base_url + "/v1", api_key=key, max_retries=0, timeout=120)


# ---------------------------------------------------------------- create


def test_a_string_input_with_instructions_answers_as_the_same_chat_completion(client, live_stack):
    response = client.responses.create(
        model=MODEL, input="Tell me a story", instructions="You are terse.", max_output_tokens=12, temperature=0
    )
    assert response.object == "response" and response.id.startswith("resp_") and response.model == MODEL
    assert response.status in ("completed", "incomplete")
    assert response.output[0].type == "message" and response.output[0].role == "assistant"
    expected = chat_text(
        client,
        [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Tell me a story"}],
        max_tokens=12,
    )
    assert response.output_text == expected
    usage = response.usage
    assert usage.input_tokens > 0 and 0 < usage.output_tokens <= 12
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    assert usage_rows(live_stack, response.id) == [("/v1/responses", usage.input_tokens, usage.output_tokens, 200)]


def test_an_item_list_input_is_the_conversation(client):
    items = [
        {"role": "developer", "content": "Answer briefly."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hello there"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Hi."}]},
        {"role": "user", "content": "How are you"},
    ]
    response = client.responses.create(model=MODEL, input=items, max_output_tokens=10, temperature=0)
    expected = chat_text(
        client,
        [
            {"role": "developer", "content": "Answer briefly."},
            {"role": "user", "content": "Hello there"},
            {"role": "assistant", "content": "Hi."},
            {"role": "user", "content": "How are you"},
        ],
        max_tokens=10,
    )
    assert response.output_text == expected


def test_max_output_tokens_cuts_the_answer_as_incomplete(client):
    response = client.responses.create(model=MODEL, input="Count forever", max_output_tokens=3, temperature=0)
    if response.usage.output_tokens == 3:
        assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
        assert response.output[0].status == "incomplete"
    else:  # the model ended its answer itself
        assert response.status == "completed" and response.incomplete_details is None


def test_text_format_json_schema_goes_through_structured_outputs(client):
    response = client.responses.create(
        model=MODEL, input="Is the sky blue?", text={"format": YES_NO}, max_output_tokens=40, temperature=0.8
    )
    assert response.status == "completed"
    assert json.loads(response.output_text)["answer"] in ("yes", "no")
    assert response.text.format.type == "json_schema" and response.text.format.name == "answer"


# ---------------------------------------------------------------- streaming


def stream_events(client, **kwargs) -> list:
    with client.responses.create(stream=True, **kwargs) as stream:
        return list(stream)


def test_streamed_events_come_in_order_and_add_up_to_the_non_streamed_response(client):
    request = dict(model=MODEL, input="Describe the sea", max_output_tokens=16, temperature=0)
    whole = client.responses.create(**request)
    events = stream_events(client, **request)
    kinds = [event.type for event in events]
    assert [event.sequence_number for event in events] == list(range(len(events)))
    deltas = [event for event in events if event.type == "response.output_text.delta"]
    assert kinds == (
        ["response.created", "response.in_progress", "response.output_item.added", "response.content_part.added"]
        + ["response.output_text.delta"] * len(deltas)
        + [
            "response.output_text.done",
            "response.content_part.done",
            "response.output_item.done",
            f"response.{whole.status}",
        ]
    )
    assert events[0].response.status == "in_progress" and events[0].response.id == events[-1].response.id
    text = "".join(event.delta for event in deltas)
    assert text == whole.output_text == events[-4].text == events[-1].response.output_text
    item_id = events[2].item.id
    assert {event.item_id for event in deltas} == {item_id} and events[-1].response.output[0].id == item_id
    assert events[-1].response.usage.output_tokens == whole.usage.output_tokens


def test_the_stream_helper_gives_the_final_response(client, live_stack):
    request = dict(model=MODEL, input="Is the sky blue?", text={"format": YES_NO}, max_output_tokens=40, temperature=0)
    whole = client.responses.create(**request)
    with client.responses.stream(**request) as stream:
        texts = [event.delta for event in stream if event.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert "".join(texts) == final.output_text == whole.output_text
    assert final.status == "completed"
    # stored before the last event went out, with its one usage row
    assert client.responses.retrieve(final.id).output_text == final.output_text
    assert [row[0] for row in usage_rows(live_stack, final.id)] == ["/v1/responses"]


# ---------------------------------------------------------------- function tools and previous_response_id


def forced_weather_call(client, **kwargs):
    return client.responses.create(
        model=MODEL,
        input="What is the weather in Paris?",
        tools=[WEATHER],
        tool_choice={"type": "function", "name": "get_weather"},
        temperature=0,
        max_output_tokens=40,
        **kwargs,
    )


def test_a_function_tool_round_trip_through_previous_response_id(client):
    first = forced_weather_call(client)
    [call] = [item for item in first.output if item.type == "function_call"]
    assert call.name == "get_weather" and call.call_id.startswith("call_") and call.id.startswith("fc_")
    assert json.loads(call.arguments)["city"] in ("Paris", "Rome")
    assert first.tools[0].name == "get_weather"

    second = client.responses.create(
        model=MODEL,
        previous_response_id=first.id,
        max_output_tokens=12,
        temperature=0,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 24 C"}],
    )
    assert second.previous_response_id == first.id
    expected = chat_text(
        client,
        [
            {"role": "user", "content": "What is the weather in Paris?"},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {
                        "id": call.call_id,
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": call.arguments},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": call.call_id, "content": "sunny, 24 C"},
        ],
        max_tokens=12,
    )
    assert second.output_text == expected
    items = client.responses.input_items.list(second.id)
    assert [item.type for item in items.data] == ["function_call_output", "function_call", "message"]


def test_a_streamed_function_call_sends_argument_deltas_that_add_up(client):
    whole = forced_weather_call(client)
    events = stream_events(
        client,
        model=MODEL,
        input="What is the weather in Paris?",
        tools=[WEATHER],
        tool_choice={"type": "function", "name": "get_weather"},
        temperature=0,
        max_output_tokens=40,
    )
    kinds = [event.type for event in events]
    assert kinds[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert events[2].item.type == "function_call" and events[2].item.arguments == ""
    assert kinds[-3:] == ["response.function_call_arguments.done", "response.output_item.done", "response.completed"]
    arguments = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    [whole_call] = whole.output
    assert arguments == events[-3].arguments == whole_call.arguments
    assert events[-1].response.output[0].call_id == events[2].item.call_id


def test_parallel_tool_calls_and_tool_choice_are_echoed(client):
    response = forced_weather_call(client, parallel_tool_calls=False)
    assert response.parallel_tool_calls is False
    assert [item.type for item in response.output] == ["function_call"]


def test_a_function_call_output_without_its_call_is_refused(client):
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(
            model=MODEL, input=[{"type": "function_call_output", "call_id": "call_x", "output": "42"}]
        )
    assert refused.value.body["param"] == "input[0].call_id"


# ---------------------------------------------------------------- store, retrieve, delete, per user


def test_store_retrieve_and_delete(client):
    response = client.responses.create(model=MODEL, input="Remember me", max_output_tokens=6, temperature=0)
    assert response.store is True
    assert client.responses.retrieve(response.id).to_dict() == response.to_dict()
    deleted = client.responses.delete(response.id)  # the SDK returns None for a 200
    assert deleted is None
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(response.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.delete(response.id)


def test_an_unstored_response_cannot_be_retrieved_or_continued(client):
    response = client.responses.create(model=MODEL, input="Forget me", max_output_tokens=4, store=False)
    assert response.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(response.id)
    with pytest.raises(openai.NotFoundError) as refused:
        client.responses.create(model=MODEL, input="and then?", previous_response_id=response.id)
    assert refused.value.body["param"] == "previous_response_id"


def test_another_users_response_id_is_a_404(client, other_client):
    response = client.responses.create(model=MODEL, input="Mine", max_output_tokens=4)
    with pytest.raises(openai.NotFoundError):
        other_client.responses.retrieve(response.id)
    with pytest.raises(openai.NotFoundError):
        other_client.responses.create(model=MODEL, input="and then?", previous_response_id=response.id)
    with pytest.raises(openai.NotFoundError):
        other_client.responses.delete(response.id)
    assert client.responses.retrieve(response.id).id == response.id  # still the owner's


# ---------------------------------------------------------------- bad input: the envelope, naming the field


@pytest.mark.parametrize(
    "kwargs, param, code",
    [
        ({"input": ""}, "input", "invalid_value"),
        ({"input": []}, "input", "invalid_value"),
        ({"input": [{"type": "telepathy", "text": "hi"}]}, "input[0].type", "invalid_value"),
        ({"input": [{"role": "user", "content": "hi"}, 7]}, "input[1]", "invalid_value"),
        ({"input": [{"type": "reasoning", "summary": []}]}, "input[0].type", "unsupported_parameter"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}]},
            "input[0].content[0].type",
            "unsupported_parameter",
        ),
        ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools[0].type", "unsupported_parameter"),
        (
            {"input": "hi", "tools": [{"type": "file_search", "vector_store_ids": ["vs_1"]}]},
            "tools[0].type",
            "unsupported_parameter",
        ),
        (
            {
                "input": "hi",
                "tools": [
                    {"type": "computer_use_preview", "display_width": 1, "display_height": 1, "environment": "linux"}
                ],
            },
            "tools[0].type",
            "unsupported_parameter",
        ),
        ({"input": "hi", "reasoning": {"effort": "high"}}, "reasoning", "unsupported_parameter"),
        ({"input": "hi", "background": True}, "background", "unsupported_parameter"),
        ({"input": "hi", "include": ["reasoning.encrypted_content"]}, "include", "unsupported_parameter"),
        ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens", "invalid_value"),
        ({"input": "hi", "temperature": "hot"}, "temperature", "invalid_type"),
        (
            {"input": "hi", "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "nonsense"}}}},
            "text.format",
            "invalid_value",
        ),
        (
            {"input": "hi", "tools": [{"type": "function", "name": "bad name!", "parameters": {}}]},
            "tools[0].name",
            "invalid_value",
        ),
    ],
)
def test_bad_input_is_a_400_naming_the_field(client, kwargs, param, code):
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(model=MODEL, **kwargs)
    error = refused.value.body
    assert (error["param"], error["code"], error["type"]) == (param, code, "invalid_request_error"), error


def test_a_previous_response_id_that_does_not_exist_is_a_404_naming_it(client):
    with pytest.raises(openai.NotFoundError) as refused:
        client.responses.create(model=MODEL, input="hi", previous_response_id="resp_doesnotexist")
    assert refused.value.body["param"] == "previous_response_id"
    assert refused.value.body["code"] == "previous_response_not_found"


def test_a_context_overflow_names_the_input(client):
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(model=MODEL, input="word " * 600, max_output_tokens=4)
    assert (refused.value.body["param"], refused.value.body["code"]) == ("input", "context_length_exceeded")
