"""Structured outputs through the whole stack on the real default model, with the official client:
`.parse()` with a Pydantic model, json_object over many seeds, vLLM's guided_* extras, streaming,
and the 400s for a schema that cannot compile or two formats at once."""

from __future__ import annotations

import json
import re

import openai
import pytest
from pydantic import BaseModel

from tests.platform.live_stack import real_model_stack

pytestmark = pytest.mark.slow
MODEL = "SmolLM2-135M-Instruct"


class City(BaseModel):
    name: str
    country: str
    is_capital: bool


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    with real_model_stack(tmp_path_factory, "structured-stack", {"max_model_len": 512, "num_kv_blocks": 128}) as live:
        yield openai.OpenAI(base_url=live.base_url + "/v1", api_key=live.api_key, max_retries=0, timeout=120)


def ask(question: str) -> list[dict]:
    return [{"role": "user", "content": question}]


def test_parse_with_a_pydantic_model(client):
    reply = client.chat.completions.parse(
        model=MODEL, messages=ask("Describe Paris as JSON."), response_format=City, temperature=0, max_tokens=80
    )
    city = reply.choices[0].message.parsed
    assert isinstance(city, City) and reply.choices[0].finish_reason == "stop"
    assert city.name and city.country


def test_json_object_is_valid_json_whatever_the_seed(client):
    texts = []
    for seed in range(8):
        reply = client.chat.completions.create(
            model=MODEL,
            messages=ask("Give me a JSON object about a cat."),
            response_format={"type": "json_object"},
            temperature=1.0,
            seed=seed,
            max_tokens=160,
        )
        choice = reply.choices[0]
        assert choice.finish_reason in ("stop", "length")
        if choice.finish_reason == "stop":  # cut at max_tokens, any JSON is unfinished
            assert isinstance(json.loads(choice.message.content), dict)
            texts.append(choice.message.content)
    assert len(texts) >= 4 and len(set(texts)) > 1  # at temperature 1 a 135M model can ramble past max_tokens


def test_guided_choice_and_regex_on_both_endpoints(client):
    choices = ["yes", "no"]
    reply = client.chat.completions.create(
        model=MODEL,
        messages=ask("Is Paris in France?"),
        temperature=0,
        max_tokens=8,
        extra_body={"guided_choice": choices},
    )
    assert reply.choices[0].message.content in choices
    completion = client.completions.create(
        model=MODEL, prompt="The year was", max_tokens=8, temperature=0, extra_body={"guided_regex": r" [0-9]{4}"}
    )
    assert re.fullmatch(r" [0-9]{4}", completion.choices[0].text)


def test_a_streamed_json_schema_answer_reassembles_to_valid_json(client):
    stream = client.chat.completions.create(
        model=MODEL,
        messages=ask("Describe Rome as JSON."),
        temperature=0,
        max_tokens=80,
        stream=True,
        response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": City.model_json_schema()}},
    )
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    City.model_validate_json(text)


@pytest.mark.parametrize(
    "extra, param",
    [
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "object", "properties": 5}},
                }
            },
            "response_format",
        ),
        ({"extra_body": {"guided_regex": "(unclosed"}}, "guided_regex"),
        ({"response_format": {"type": "json_object"}, "extra_body": {"guided_choice": ["a"]}}, "guided_choice"),
        ({"extra_body": {"structured_outputs": {"regex": "a", "choice": ["a"]}}}, "structured_outputs"),
    ],
)
def test_what_cannot_be_honoured_is_a_400_naming_the_field(client, extra, param):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=ask("hi"), max_tokens=4, **extra)
    assert info.value.body["param"] == param
