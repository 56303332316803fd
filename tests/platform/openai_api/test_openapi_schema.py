"""The served OpenAPI schema stays true: every route is in it, and real response bodies match it."""

from __future__ import annotations

import re

import pytest
from django.test import Client
from django.urls import URLPattern

from generation.result import Result
from generation.services import Generation
from openai_api import formatting, urls
from openai_api.calls import ApiCall
from openai_api.responses_serializers import ResponseCreateRequestSerializer
from openai_api.serializers import ChatCompletionRequestSerializer, CompletionRequestSerializer

pytestmark = pytest.mark.django_db


@pytest.fixture(scope="module")
def schema(django_db_blocker):
    with django_db_blocker.unblock():
        response = Client().get("/v1/openapi.json")
    assert response.status_code == 200
    return response.json()


def _openapi_path(pattern: URLPattern) -> str:
    return "/" + re.sub(r"<\w+:(\w+)>", r"{\1}", str(pattern.pattern))


def test_every_route_and_method_is_documented(schema):
    assert schema["openapi"].startswith("3.")
    for pattern in urls.urlpatterns:
        view_cls = getattr(pattern.callback, "cls", None)
        path = _openapi_path(pattern)
        if path == "/v1/openapi.json":
            continue
        methods = {m for m in ("get", "post", "delete") if hasattr(view_cls, m)}
        assert path in schema["paths"], path
        assert set(schema["paths"][path]) >= methods, path


def _component(schema, ref_holder: dict) -> dict:
    ref = ref_holder.get("$ref") or ref_holder["allOf"][0]["$ref"]
    return schema["components"]["schemas"][ref.rsplit("/", 1)[1]]


def _request_component(schema, path):
    body = schema["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
    return _component(schema, body)


@pytest.mark.parametrize(
    "path, serializer",
    [
        ("/v1/chat/completions", ChatCompletionRequestSerializer),
        ("/v1/completions", CompletionRequestSerializer),
        ("/v1/responses", ResponseCreateRequestSerializer),
    ],
)
def test_request_bodies_are_the_serializers_that_validate(schema, path, serializer):
    component = _request_component(schema, path)
    assert set(component["properties"]) == set(serializer().fields)
    assert "model" in component["required"]


def _check_body(schema, body: dict, component: dict, where: str):
    """Recursively: a real body has only documented properties, and every required one."""
    assert set(body) <= set(component["properties"]), where
    assert set(component.get("required", [])) <= set(body), where
    for name, value in body.items():
        prop = component["properties"][name]
        target = prop.get("items", prop) if isinstance(value, list) else prop
        if isinstance(value, list):
            value = value[0] if value else None
        if isinstance(value, dict) and ("$ref" in target or "allOf" in target):
            _check_body(schema, value, _component(schema, target), f"{where}.{name}")


def _result(logprobs: bool) -> dict:
    entry = {"token_id": 1, "token": "hi", "logprob": -0.5, "top": [{"token_id": 1, "token": "hi", "logprob": -0.5}]}
    result = Result()
    result.add(
        {
            "type": "delta",
            "index": 0,
            "text": "hi",
            "token_ids": [1],
            "logprobs": [entry] if logprobs else [],
            "finish_reason": "length",
            "stop_reason": None,
        }
    )
    result.add(
        {
            "type": "finish",
            "finish_reasons": ["length"],
            "usage": {"prompt_tokens": 3, "completion_tokens": 1, "cached_tokens": 0},
            "metrics": {},
        }
    )
    return result


@pytest.mark.parametrize(
    "endpoint, path, build",
    [
        ("chat", "/v1/chat/completions", formatting.chat_response),
        ("completions", "/v1/completions", formatting.completion_response),
    ],
)
def test_response_bodies_match_their_documented_components(schema, endpoint, path, build):
    gen = Generation(
        source="api", endpoint=path, user=None, model="tiny", prompts=[[1, 2, 3]], sampling_params={}, request_id="x"
    )
    body = build(ApiCall(kind=endpoint, gen=gen, logprobs=1), _result(logprobs=True))
    ok = schema["paths"][path]["post"]["responses"]["200"]["content"]["application/json"]["schema"]
    _check_body(schema, body, _component(schema, ok), path)
    error = schema["paths"][path]["post"]["responses"]["400"]["content"]["application/json"]["schema"]
    from errors import InvalidRequest
    from openai_api.errors import error_body

    _check_body(schema, error_body(InvalidRequest("bad", param="n")), _component(schema, error), path + " 400")


def test_model_cards_match_the_documented_model(schema):
    from openai_api.views import model_card

    ok = schema["paths"]["/v1/models/{model}"]["get"]["responses"]["200"]["content"]["application/json"]["schema"]
    _check_body(schema, model_card("tiny", {"max_model_len": 8, "created": 1}), _component(schema, ok), "model")
