"""Nothing accepted and ignored on /v1 (issues 19 and 21): every parameter is honoured or a 400 naming it.

Black box, with the official openai client against the live stack. Honoured parameters are compared
with the bare engine in-process (the reference its own tests check against HF transformers) and
shown to change the answer; refused ones must come back as a 400 whose error.param names them.
"""

from __future__ import annotations

import openai
import pytest

from inference import LLM, SamplingParams
from inference.loader import load_tokenizer
from inference.sampling_params import bad_words_token_ids

pytestmark = pytest.mark.slow
PROMPT_IDS = [11, 12, 13, 14, 15]
VOCAB = 512  # tests/tiny_models.VOCAB: the tiny tokenizer's size
HELLO = [{"role": "user", "content": "hello there"}]


@pytest.fixture(scope="module")
def offline(tiny_model_dir):
    from tests.platform.live_stack import ENGINE_ARGS

    return LLM(model=tiny_model_dir, **ENGINE_ARGS)


def offline_text(offline, max_tokens: int = 8, **params) -> str:
    return (
        offline.generate(
            prompt_token_ids=[PROMPT_IDS],
            use_tqdm=False,
            sampling_params=SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **params),
        )[0]
        .outputs[0]
        .text
    )


def complete(client, live_stack, max_tokens: int | None = 8, **extra):
    kwargs = {} if max_tokens is None else {"max_tokens": max_tokens}
    return client.completions.create(
        model=live_stack.model_name,
        prompt=PROMPT_IDS,
        temperature=0,
        extra_body={"ignore_eos": True, **extra},
        **kwargs,
    )


def chat(client, live_stack, messages, **kwargs):
    return client.chat.completions.create(
        model=live_stack.model_name,
        messages=messages,
        temperature=0,
        max_tokens=8,
        extra_body={"ignore_eos": True},
        **kwargs,
    )


# ---------------------------------------------------------------- honoured


@pytest.mark.parametrize(
    "params",
    [{"logit_bias": {"42": 100}}, {"logit_bias": {"7": -100, "300": 8.5}}, {"allowed_token_ids": [20, 30, 40]}],
    ids=["logit_bias-forces", "logit_bias-mixed", "allowed_token_ids"],
)
def test_token_restrictions_are_served_and_equal_the_bare_engine(client, live_stack, offline, params):
    reply = complete(client, live_stack, **params)
    engine_params = {k: ({int(t): b for t, b in v.items()} if k == "logit_bias" else v) for k, v in params.items()}
    assert reply.choices[0].text == offline_text(offline, **engine_params)
    assert reply.choices[0].text != offline_text(offline)  # it took effect


def test_logit_bias_through_the_chat_endpoint_forces_the_token(client, live_stack, tiny_model_dir):
    reply = chat(client, live_stack, HELLO, logit_bias={"42": 100})
    assert reply.choices[0].message.content == load_tokenizer(tiny_model_dir).decode([42] * 8)


def a_word_the_model_writes(offline, tokenizer) -> str:
    """The text of one generated token that tokenizes back to that token (random weights write bytes)."""
    ids = (
        offline.generate(
            prompt_token_ids=[PROMPT_IDS],
            use_tqdm=False,
            sampling_params=SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
        )[0]
        .outputs[0]
        .token_ids
    )
    for token in ids:
        word = tokenizer.decode([token]).strip()
        if word and "\ufffd" not in word and [token] in bad_words_token_ids(tokenizer, [word]):
            return word
    pytest.fail(f"no clean single-token word in {ids}")


def test_bad_words_are_never_written(client, live_stack, offline, tiny_model_dir):
    word = a_word_the_model_writes(offline, load_tokenizer(tiny_model_dir))
    reply = complete(client, live_stack, bad_words=[word])
    assert reply.choices[0].text == offline_text(offline, bad_words=[word])
    assert reply.choices[0].text != offline_text(offline)  # the word's token was banned


def test_completions_default_max_tokens_is_16(client, live_stack):
    reply = complete(client, live_stack, max_tokens=None)
    assert reply.usage.completion_tokens == 16 and reply.choices[0].finish_reason == "length"


def test_developer_is_the_system_role(client, live_stack):
    def answer(role):
        return chat(client, live_stack, [{"role": role, "content": "be brief"}, *HELLO]).choices[0].message.content

    assert answer("developer") == answer("system")
    assert answer("developer") != chat(client, live_stack, HELLO).choices[0].message.content


def test_text_parts_are_joined_with_newlines(client, live_stack):
    parts = [{"type": "text", "text": "hello"}, {"type": "text", "text": "there"}]
    joined = chat(client, live_stack, [{"role": "user", "content": parts}]).choices[0].message.content
    assert joined == chat(client, live_stack, [{"role": "user", "content": "hello\nthere"}]).choices[0].message.content
    assert joined != chat(client, live_stack, [{"role": "user", "content": "hellothere"}]).choices[0].message.content


def test_user_is_recorded_on_the_usage_row(client, live_stack):
    reply = chat(client, live_stack, HELLO, user="end-user-17")
    rows = live_stack.sql("SELECT end_user FROM usage_usagerecord WHERE request_id = ?", (reply.id,))
    assert rows == [("end-user-17",)]


def test_the_largest_64_bit_seed_is_honoured(client, live_stack):
    def sampled(seed):
        return (
            client.chat.completions.create(
                model=live_stack.model_name, messages=HELLO, temperature=1.0, max_tokens=8, seed=seed
            )
            .choices[0]
            .message.content
        )

    assert sampled(2**64 - 1) == sampled(2**64 - 1) != sampled(2**64 - 2)


def test_harmless_openai_fields_are_logged_not_refused(client, live_stack):
    reply = chat(client, live_stack, HELLO, metadata={"k": "v"}, store=False, service_tier="auto")
    assert reply.choices[0].finish_reason == "length"
    log = (live_stack.log_dir / "web.log").read_text()
    assert "were present in the request but ignored: ['metadata', 'service_tier', 'store']" in log


# ---------------------------------------------------------------- refused with a 400 naming the parameter

CHAT_REFUSALS = [
    ({"max_tokens": "8"}, "max_tokens"),
    ({"temperature": "0.5"}, "temperature"),
    ({"stream": "true"}, "stream"),
    ({"model": 5}, "model"),
    ({"top_k": 10**9}, "top_k"),
    ({"top_k": VOCAB + 1}, "top_k"),
    ({"stop_token_ids": [10**12]}, "stop_token_ids"),
    ({"stop_token_ids": [VOCAB]}, "stop_token_ids"),
    ({"stop_token_ids": ["3"]}, "stop_token_ids[0]"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"seed": 2**70}, "seed"),
    ({"seed": -(2**63) - 1}, "seed"),
    ({"logit_bias": {"5": 101}}, "logit_bias[5]"),
    ({"logit_bias": {"five": 1}}, "logit_bias"),
    ({"logit_bias": {"²": 1}}, "logit_bias"),
    ({"logit_bias": {"9" * 5000: 1}}, "logit_bias"),
    ({"logit_bias": {str(VOCAB): 1}}, "logit_bias"),
    ({"allowed_token_ids": []}, "allowed_token_ids"),
    ({"allowed_token_ids": [VOCAB + 3]}, "allowed_token_ids"),
    ({"bad_words": [""]}, "bad_words[0]"),
    ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, "tools[0].function.name"),
    ({"tools": {"type": "function"}}, "tools"),
    ({"tool_choice": "required"}, "tool_choice"),  # nothing to call
    ({"tool_choice": "sometimes"}, "tool_choice"),
    ({"parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ({"functions": [{"name": "f"}]}, "functions"),
    ({"function_call": "auto"}, "function_call"),
    ({"audio": {"voice": "alloy", "format": "wav"}}, "audio"),
    ({"modalities": ["text", "audio"]}, "modalities"),
    ({"prediction": {"type": "content", "content": "x"}}, "prediction"),
    ({"reasoning_effort": "low"}, "reasoning_effort"),
    ({"web_search_options": {}}, "web_search_options"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].tool_call_id"),
    ({"messages": [{"role": "tool", "content": "x", "tool_call_id": "c1"}]}, "messages[0].tool_call_id"),  # no call
    (
        {"messages": [{"role": "assistant", "content": "", "tool_calls": [{"id": "c1"}]}]},
        "messages[0].tool_calls[0].function",
    ),
    (
        {
            "messages": [
                {"role": "user", "content": "x", "tool_calls": []},
                {
                    "role": "user",
                    "content": "y",
                    "tool_calls": [{"id": "c1", "function": {"name": "f", "arguments": "{}"}}],
                },
            ]
        },
        "messages[1].tool_calls",
    ),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    (
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
        "messages[0].content",
    ),
]


def refused(call) -> openai.BadRequestError:
    with pytest.raises(openai.BadRequestError) as caught:
        call()
    return caught.value


@pytest.mark.parametrize("body, param", CHAT_REFUSALS, ids=[p for _, p in CHAT_REFUSALS])
def test_chat_refuses_with_a_400_naming_the_parameter(client, live_stack, body, param):
    body = dict(body)
    messages = body.pop("messages", HELLO)
    error = refused(
        lambda: client.chat.completions.create(
            model=live_stack.model_name, messages=messages, max_tokens=4, extra_body=body
        )
    )
    assert error.param == param, error.body


@pytest.mark.parametrize(
    "body, param",
    [
        ({"max_tokens": "8"}, "max_tokens"),
        ({"top_k": 10**9}, "top_k"),
        ({"stop_token_ids": [10**12]}, "stop_token_ids"),
        ({"logprobs": "2"}, "logprobs"),
        ({"seed": 2**70}, "seed"),
    ],
)
def test_completions_refuse_with_a_400_naming_the_parameter(client, live_stack, body, param):
    error = refused(lambda: client.completions.create(model=live_stack.model_name, prompt="hi", extra_body=body))
    assert error.param == param, error.body


def test_the_neutral_values_of_unsupported_fields_are_accepted(client, live_stack):
    reply = chat(client, live_stack, HELLO, tools=[], tool_choice="none", modalities=["text"])
    assert reply.choices[0].finish_reason == "length"


def test_a_tokenizer_without_a_chat_template_is_a_400_that_says_so(tmp_path, tiny_model_dir):
    """In-process: the web tier's tokenizer for a model folder whose tokenizer has no template."""
    import shutil

    from errors import InvalidRequest
    from generation import tokenization

    folder = tmp_path / "no-template"
    shutil.copytree(tiny_model_dir, folder)
    tokenizer = load_tokenizer(str(folder))
    tokenizer.chat_template = None
    tokenizer.save_pretrained(folder)
    for leftover in folder.glob("chat_template.*"):
        leftover.unlink()
    with pytest.raises(InvalidRequest) as caught:
        tokenization.chat_prompt_ids(str(folder), HELLO)
    assert caught.value.param == "messages" and "no chat template" in caught.value.message


# ---------------------------------------------------------------- the OpenAPI schema says the same


@pytest.mark.django_db
def test_the_schema_has_json_bodies_and_typed_message_content():
    from django.test import Client

    schema = Client().get("/v1/openapi.json").json()
    for path in ("/v1/chat/completions", "/v1/completions"):
        assert set(schema["paths"][path]["post"]["requestBody"]["content"]) == {"application/json"}, path
    message = schema["components"]["schemas"]["Message"]["properties"]
    content = message["content"]["oneOf"]
    assert content[0] == {"type": "string"}
    assert content[1]["items"]["properties"]["type"]["enum"] == ["text"]
    assert "tool_call_id" in message
    request = schema["components"]["schemas"]["ChatCompletionRequest"]["properties"]
    assert {"logit_bias", "allowed_token_ids", "bad_words", "tools", "tool_choice", "parallel_tool_calls"} <= set(
        request
    )
    assert request["seed"]["maximum"] == 2**64 - 1
