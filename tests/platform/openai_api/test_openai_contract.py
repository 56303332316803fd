"""The official `openai` client against a live web server + engine worker + Redis (tiny model)."""

from __future__ import annotations

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from inference import LLM, SamplingParams

pytestmark = pytest.mark.slow
MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say something."}]
PROMPT_IDS = [5, 17, 42, 99, 7, 3, 11]


@pytest.fixture(scope="module")
def offline(tiny_model_dir):
    """The bare engine in-process: the reference for what the served stack must return."""
    from tests.platform.live_stack import ENGINE_ARGS

    return LLM(model=tiny_model_dir, **ENGINE_ARGS)


def test_models_list_and_retrieve(client, live_stack):
    models = client.models.list()
    assert [m.id for m in models.data] == [live_stack.model_name]
    assert client.models.retrieve(live_stack.model_name).id == live_stack.model_name
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")


def test_chat_non_streamed_carries_usage_and_matches_the_bare_engine(client, live_stack, offline):
    reply = client.chat.completions.create(
        model=live_stack.model_name, messages=MESSAGES, max_tokens=12, temperature=0, extra_body={"ignore_eos": True}
    )
    tok = offline.get_tokenizer()
    prompt_ids = tok.encode(
        tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False), add_special_tokens=False
    )
    expected = offline.generate(
        prompt_token_ids=[prompt_ids],
        use_tqdm=False,
        sampling_params=SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
    )[0].outputs[0]
    assert reply.object == "chat.completion" and reply.id.startswith("chatcmpl-")
    assert reply.choices[0].message.role == "assistant"
    assert reply.choices[0].message.content == expected.text
    assert reply.choices[0].finish_reason == "length"
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (len(prompt_ids), 12)
    assert reply.usage.total_tokens == len(prompt_ids) + 12
    row = live_stack.sql(
        "SELECT endpoint, model, source, prompt_tokens, completion_tokens, status_code, ttft_ms, "
        "latency_ms FROM usage_usagerecord WHERE request_id = ?",
        (reply.id,),
    )
    assert row and row[0][:6] == ("/v1/chat/completions", live_stack.model_name, "api", len(prompt_ids), 12, 200)
    assert 0 < row[0][6] <= row[0][7]


def test_chat_stream_with_usage_equals_the_non_streamed_text_for_the_same_seed(client, live_stack):
    args = dict(model=live_stack.model_name, messages=MESSAGES, max_tokens=16, temperature=1.0, seed=1234)
    whole = client.chat.completions.create(**args)
    chunks = list(client.chat.completions.create(**args, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    content = [c for c in chunks if c.choices and c.choices[0].delta.content]
    assert len(content) >= 2, "tokens arrive as they are generated"
    finishing = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finishing) == 1 and finishing[0] is chunks[-2]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert all(c.usage is None for c in chunks[:-1])
    assert "".join(c.choices[0].delta.content for c in content) == whole.choices[0].message.content


def test_completions_with_token_id_prompt_match_the_bare_engine(client, live_stack, offline):
    expected = offline.generate(
        prompt_token_ids=[PROMPT_IDS],
        use_tqdm=False,
        sampling_params=SamplingParams(temperature=0, max_tokens=10, ignore_eos=True),
    )[0].outputs[0]
    reply = client.completions.create(
        model=live_stack.model_name, prompt=PROMPT_IDS, max_tokens=10, temperature=0, extra_body={"ignore_eos": True}
    )
    assert reply.object == "text_completion" and reply.choices[0].text == expected.text
    assert reply.usage.prompt_tokens == len(PROMPT_IDS) and reply.usage.completion_tokens == 10
    streamed = client.completions.create(
        model=live_stack.model_name,
        prompt=PROMPT_IDS,
        max_tokens=10,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    assert "".join(c.choices[0].text for c in streamed if c.choices) == expected.text


def test_n2_gives_two_choices_reproducing_seeded_single_requests(client, live_stack):
    args = dict(
        model=live_stack.model_name, prompt=PROMPT_IDS, max_tokens=8, temperature=1.0, extra_body={"ignore_eos": True}
    )
    pair = client.completions.create(**args, n=2, seed=5)
    assert sorted(c.index for c in pair.choices) == [0, 1]
    assert pair.usage.completion_tokens == 16
    singles = [client.completions.create(**args, seed=seed).choices[0].text for seed in (5, 6)]
    assert [c.text for c in sorted(pair.choices, key=lambda c: c.index)] == singles
    streamed = client.chat.completions.create(
        model=live_stack.model_name, messages=MESSAGES, max_tokens=6, n=2, stream=True, seed=3
    )
    indexes = {c.choices[0].index for c in streamed if c.choices}
    assert indexes == {0, 1}


def test_stop_strings_end_the_text_before_the_stop(client, live_stack):
    args = dict(model=live_stack.model_name, prompt=PROMPT_IDS, temperature=0, extra_body={"ignore_eos": True})
    full = client.completions.create(**args, max_tokens=24).choices[0].text
    stop = full[8:11]
    assert stop.strip(), f"need a visible stop string, got {full!r}"
    cut = client.completions.create(**args, max_tokens=24, stop=[stop, "never-appears"]).choices[0]
    assert cut.finish_reason == "stop"
    assert cut.text == full[: full.index(stop)]
    streamed = client.completions.create(**args, max_tokens=24, stop=stop, stream=True)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == cut.text


def test_logprobs_for_chat_and_completions(client, live_stack):
    chat = client.chat.completions.create(
        model=live_stack.model_name, messages=MESSAGES, max_tokens=5, temperature=0, logprobs=True, top_logprobs=3
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    assert "".join(t.token for t in content) == chat.choices[0].message.content
    for token in content:
        assert len(token.top_logprobs) == 3 and token.logprob <= 0
        assert token.logprob == pytest.approx(max(t.logprob for t in token.top_logprobs))  # greedy
    text = client.completions.create(
        model=live_stack.model_name, prompt=PROMPT_IDS, max_tokens=5, temperature=0, logprobs=2
    )
    lp = text.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert lp.text_offset[0] == 0 and all(len(top) <= 2 for top in lp.top_logprobs)


@pytest.mark.parametrize(
    "kwargs, param",
    [
        ({"temperature": -1}, "temperature"),
        ({"top_p": 2}, "top_p"),
        ({"n": 0}, "n"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"extra_body": {"top_k": -5}}, "top_k"),
    ],
)
def test_invalid_parameters_are_400_naming_the_param(client, live_stack, kwargs, param):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=live_stack.model_name, messages=MESSAGES, **kwargs)
    assert info.value.status_code == 400 and info.value.body["param"] == param
    assert info.value.body["type"] == "invalid_request_error"


def test_error_classes_match_openai(client, live_stack):
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=live_stack.base_url + "/v1", api_key="tsk-wrong", max_retries=0).models.list()
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="gpt-nope", messages=MESSAGES)
    assert info.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=live_stack.model_name, prompt=[5] * 600, max_tokens=4)
    assert info.value.body["code"] == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=live_stack.model_name, prompt=[3] * 500, max_tokens=100)
    assert "maximum context length is 512" in info.value.body["message"]


@pytest.mark.parametrize("body", [b"{not json", b"[1, 2]", b"", '{"model": "\xff"}'.encode("latin-1")])
def test_malformed_json_is_a_400_envelope_never_a_500(live_stack, body):
    response = httpx.post(
        live_stack.base_url + "/v1/chat/completions",
        content=body,
        headers={"Authorization": f"Bearer {live_stack.api_key}", "Content-Type": "application/json"},
    )
    assert response.status_code == 400
    assert set(response.json()["error"]) == {"message", "type", "param", "code"}


def test_missing_key_unknown_route_and_wrong_method_use_the_envelope(live_stack):
    missing = httpx.post(live_stack.base_url + "/v1/chat/completions", json={})
    assert missing.status_code == 401 and missing.json()["error"]["code"] == "missing_api_key"
    unknown = httpx.get(live_stack.base_url + "/v1/nope")
    assert unknown.status_code == 404 and unknown.json()["error"]["type"] == "invalid_request_error"
    wrong = httpx.get(live_stack.base_url + "/v1/chat/completions")
    assert wrong.status_code == 405 and "error" in wrong.json()


def test_every_v1_answer_carries_rate_limit_headers(live_stack):
    response = httpx.post(
        live_stack.base_url + "/v1/completions",
        json={"model": live_stack.model_name, "prompt": PROMPT_IDS, "max_tokens": 2},
        headers={"Authorization": f"Bearer {live_stack.api_key}"},
        timeout=60,
    )
    assert response.status_code == 200
    assert any(name.lower().startswith("x-ratelimit-") for name in response.headers)


def test_a_stream_is_counted_for_metrics_once_it_has_ended(live_stack):
    """The count is written after the last chunk (not before the first token), and before the response ends."""

    def completions_200s() -> float:
        text = httpx.get(live_stack.base_url + "/metrics").text
        wanted = {"route": "/v1/completions", "method": "POST", "status": "200"}.items()
        return sum(
            s.value
            for family in text_string_to_metric_families(text)
            for s in family.samples
            if s.name == "tessera_http_requests_total" and wanted <= s.labels.items()
        )

    before = completions_200s()
    body = {"model": live_stack.model_name, "prompt": PROMPT_IDS, "max_tokens": 3, "stream": True}
    with httpx.stream(
        "POST",
        live_stack.base_url + "/v1/completions",
        json=body,
        timeout=60,
        headers={"Authorization": f"Bearer {live_stack.api_key}"},
    ) as response:
        lines = [line for line in response.iter_lines() if line]
    assert response.status_code == 200 and lines[-1] == "data: [DONE]"
    assert completions_200s() == before + 1


def test_health_and_prometheus_metrics(live_stack):
    health = httpx.get(live_stack.base_url + "/health").json()
    assert health["status"] == "ok" and len(health["workers"]) == 1
    text = httpx.get(live_stack.base_url + "/metrics").text
    assert "tessera_engine_up{" in text and "tessera_engine_kv_usage{" in text
    completions = {"route": "/v1/completions", "method": "POST", "status": "200"}.items()
    assert any(
        s.name == "tessera_http_requests_total" and completions <= s.labels.items()
        for family in text_string_to_metric_families(text)
        for s in family.samples
    )
    for line in text.splitlines():
        assert line.startswith("#") or len(line.rsplit(" ", 1)) == 2, line
