"""The Responses event stream from engine events, in process: the SDK's own stream accumulator takes
every sequence (text, hermes tool calls, an engine failure mid-stream), the streamed items equal the
JSON answer's, and the bodies match the documented OpenAPI component."""

from __future__ import annotations

import json

import pytest
from django.test import Client
from openai._models import construct_type
from openai._types import omit
from openai.lib.streaming.responses._responses import ResponseStreamState
from openai.types.responses import ResponseStreamEvent

from errors import EngineFailure
from generation.services import Generation
from openai_api import responses_format
from openai_api.calls import ApiCall, ToolUse
from openai_api.responses import ResponseCall
from tests.platform.openai_api.test_openapi_schema import _check_body, _component

pytestmark = pytest.mark.django_db
TOOLS = [{"type": "function", "name": "get_weather", "parameters": {"type": "object"}}]


def response_call(tool_use: ToolUse | None = None, **data) -> ResponseCall:
    gen = Generation(
        source="api",
        endpoint="/v1/responses",
        user=None,
        model="tiny",
        prompts=[[1, 2, 3]],
        sampling_params={},
        request_id="resp_test",
    )
    return ResponseCall(
        call=ApiCall(kind="chat", gen=gen, tools=tool_use), data={"model": "tiny", **data}, conversation=[]
    )


def run(rc: ResponseCall, texts: list[str], finish: str | None = "stop", error: dict | None = None):
    """Feed deltas (then a finish or an error event) through the writer; the payloads and the SDK's events."""
    writer = responses_format.EventWriter(rc)
    chunks = writer.start()
    for i, text in enumerate(texts):
        last = i == len(texts) - 1 and error is None
        event = {"type": "delta", "index": 0, "text": text, "token_ids": [1], "finish_reason": finish if last else None}
        rc.call.gen.result.add(event)
        chunks += writer.delta(event)
    if error is None:
        rc.call.gen.result.add(
            {
                "type": "finish",
                "finish_reasons": [finish],
                "usage": {"prompt_tokens": 3, "completion_tokens": len(texts), "cached_tokens": 0},
            }
        )
        body, closing = writer.finish(rc.call.gen.result)
        chunks += closing
    else:
        chunks += writer.error(EngineFailure.from_event({"type": "error", **error}))
    payloads = [json.loads(chunk.decode().split("data: ", 1)[1]) for chunk in chunks]
    assert all(chunk.decode().startswith(f"event: {p['type']}\n") for chunk, p in zip(chunks, payloads))
    state = ResponseStreamState(input_tools=omit, text_format=omit)
    sdk_events = [e for p in payloads for e in state.handle_event(construct_type(type_=ResponseStreamEvent, value=p))]
    return payloads, sdk_events


@pytest.fixture(scope="module")
def schema(django_db_blocker):
    with django_db_blocker.unblock():
        return Client().get("/v1/openapi.json").json()


def test_a_text_stream_ends_with_the_json_answer(schema):
    rc = response_call()
    payloads, sdk_events = run(rc, ["Hel", "lo", " there"])
    assert [p["sequence_number"] for p in payloads] == list(range(len(payloads)))
    final = payloads[-1]["response"]
    assert payloads[-1]["type"] == "response.completed" and sdk_events[-1].response.output_text == "Hello there"
    whole = responses_format.response_body(rc, rc.call.gen.result)
    assert [(i["type"], i["content"][0]["text"]) for i in final["output"]] == [
        (i["type"], i["content"][0]["text"]) for i in whole["output"]
    ]
    assert (
        final["usage"]
        == whole["usage"]
        == {
            "input_tokens": 3,
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": 3,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": 6,
        }
    )
    ok = schema["paths"]["/v1/responses"]["post"]["responses"]["200"]["content"]["application/json"]["schema"]
    _check_body(schema, whole, _component(schema, ok), "/v1/responses")
    _check_body(schema, final, _component(schema, ok), "/v1/responses stream")


def test_hermes_tool_calls_stream_as_function_call_items():
    rc = response_call(ToolUse(tool_choice="auto", parser="hermes"), tools=TOOLS)
    text = 'Let me check.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    payloads, sdk_events = run(rc, [text[:20], text[20:50], text[50:]])
    kinds = [p["type"] for p in payloads]
    assert kinds.count("response.output_item.added") == 2 and kinds.count("response.output_item.done") == 2
    assert kinds[-3:] == ["response.function_call_arguments.done", "response.output_item.done", "response.completed"]
    final = sdk_events[-1].response
    assert [item.type for item in final.output] == ["message", "function_call"]
    assert final.output[0].content[0].text == "Let me check."
    assert json.loads(final.output[1].arguments) == {"city": "Paris"} and final.output[1].name == "get_weather"
    whole = responses_format.response_body(rc, rc.call.gen.result)
    assert [i.get("arguments") for i in whole["output"]] == [None, final.output[1].arguments]


def test_parallel_tool_calls_false_streams_the_first_call_only():
    rc = response_call(
        ToolUse(tool_choice="auto", parser="hermes", parallel=False), tools=TOOLS, parallel_tool_calls=False
    )
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "%s"}}\n</tool_call>'
    _, sdk_events = run(rc, [call % "Paris", call % "Rome"])
    assert [item.type for item in sdk_events[-1].response.output] == ["function_call"]
    assert len(responses_format.response_body(rc, rc.call.gen.result)["output"]) == 1


def test_an_engine_failure_mid_stream_is_an_error_event_then_response_failed():
    payloads, _ = run(response_call(), ["partial"], error={"code": "engine_error", "message": "boom"})
    kinds = [p["type"] for p in payloads]
    assert kinds == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "error",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.failed",
    ]
    error = payloads[kinds.index("error")]
    assert (error["code"], error["message"]) == ("engine_error", "boom")
    failed = payloads[-1]
    assert failed["type"] == "response.failed" and failed["response"]["status"] == "failed"
    assert failed["response"]["error"]["code"] == "engine_error"
    assert failed["response"]["output"][0]["status"] == "incomplete"


def test_a_cut_answer_ends_with_response_incomplete():
    payloads, sdk_events = run(response_call(max_output_tokens=2), ["a", "b"], finish="length")
    assert payloads[-1]["type"] == "response.incomplete"
    assert payloads[-1]["response"]["incomplete_details"] == {"reason": "max_output_tokens"}
    assert payloads[-1]["response"]["output"][0]["status"] == "incomplete"
