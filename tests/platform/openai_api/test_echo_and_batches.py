"""/v1/completions echo with prompt logprobs (against HF transformers), max_tokens 0, streamed echo, batched
prompts, and vLLM's /tokenize, /detokenize and /tokenizer_info, on the live stack with the official openai client."""

from __future__ import annotations

import openai
import pytest
import requests
import torch

PROMPT = "the cat sat on the mat and the dog ran in the park"


@pytest.fixture(scope="module")
def hf(tiny_model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return (
        AutoTokenizer.from_pretrained(tiny_model_dir),
        AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval(),
    )


def hf_prompt_logprobs(hf, ids: list[int]) -> list[float]:
    """log P(token i | tokens < i) for i >= 1, from HF transformers."""
    with torch.no_grad():
        logprobs = torch.log_softmax(hf[1](torch.tensor([ids])).logits[0].float(), dim=-1)
    return [logprobs[i - 1, ids[i]].item() for i in range(1, len(ids))]


def post(live_stack, route: str, body: dict | None = None, key: str | None = "default"):
    headers = {"Authorization": f"Bearer {live_stack.api_key if key == 'default' else key}"} if key else {}
    if body is None:
        return requests.get(live_stack.base_url + route, headers=headers, timeout=60)
    return requests.post(live_stack.base_url + route, json=body, headers=headers, timeout=60)


def test_echo_with_logprobs_gives_the_prompt_tokens_logprobs_of_hf(client, live_stack, hf):
    ids = hf[0].encode(PROMPT)
    out = client.completions.create(
        model=live_stack.model_name, prompt=PROMPT, max_tokens=1, logprobs=1, echo=True, temperature=0
    )
    plain = client.completions.create(model=live_stack.model_name, prompt=PROMPT, max_tokens=1, temperature=0)
    choice = out.choices[0]
    assert choice.text == PROMPT + plain.choices[0].text
    lp = choice.logprobs
    assert len(lp.tokens) == len(ids) + 1 == out.usage.prompt_tokens + out.usage.completion_tokens
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[1 : len(ids)] == pytest.approx(hf_prompt_logprobs(hf, ids), abs=1e-3)
    assert [hf[0].convert_tokens_to_string([t]) for t in hf[0].convert_ids_to_tokens(ids[1:])] == lp.tokens[
        1 : len(ids)
    ]
    assert all(len(top) >= 1 for top in lp.top_logprobs[1:])
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0


def test_echo_twice_still_computes_every_prompt_position(client, live_stack, hf):
    """The second request would hit the first one's prefix-cache blocks; prompt logprobs bypass them."""
    prompt = " ".join([PROMPT] * 4)
    answers = [
        client.completions.create(
            model=live_stack.model_name, prompt=prompt, max_tokens=1, logprobs=0, echo=True, temperature=0
        )
        for _ in range(2)
    ]
    expected = hf_prompt_logprobs(hf, hf[0].encode(prompt))
    for out in answers:
        assert out.usage.prompt_tokens_details.cached_tokens == 0
        assert out.choices[0].logprobs.token_logprobs[1 : len(expected) + 1] == pytest.approx(expected, abs=1e-3)


def test_max_tokens_0_with_echo_is_the_prompt_alone(client, live_stack, hf):
    ids = hf[0].encode(PROMPT)
    out = client.completions.create(model=live_stack.model_name, prompt=ids, max_tokens=0, logprobs=1, echo=True)
    choice = out.choices[0]
    assert choice.text == hf[0].decode(ids)
    assert len(choice.logprobs.tokens) == len(ids) and out.usage.completion_tokens == 0
    assert choice.logprobs.token_logprobs[1:] == pytest.approx(hf_prompt_logprobs(hf, ids), abs=1e-3)


def test_max_tokens_0_needs_echo(client, live_stack):
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=live_stack.model_name, prompt=PROMPT, max_tokens=0)
    assert caught.value.body["param"] == "max_tokens"


def test_echo_without_logprobs_prepends_the_prompt(client, live_stack):
    plain = client.completions.create(model=live_stack.model_name, prompt=PROMPT, max_tokens=4, temperature=0)
    echoed = client.completions.create(
        model=live_stack.model_name, prompt=PROMPT, max_tokens=4, temperature=0, echo=True
    )
    assert echoed.choices[0].text == PROMPT + plain.choices[0].text and echoed.choices[0].logprobs is None


def test_streamed_echo_opens_with_the_prompt_and_its_logprobs(client, live_stack, hf):
    ids = hf[0].encode(PROMPT)
    chunks = list(
        client.completions.create(
            model=live_stack.model_name, prompt=PROMPT, max_tokens=3, logprobs=1, echo=True, temperature=0, stream=True
        )
    )
    plain = client.completions.create(model=live_stack.model_name, prompt=PROMPT, max_tokens=3, temperature=0)
    first = chunks[0].choices[0]
    assert first.text == PROMPT and first.logprobs.token_logprobs[0] is None
    assert first.logprobs.token_logprobs[1:] == pytest.approx(hf_prompt_logprobs(hf, ids), abs=1e-3)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == PROMPT + plain.choices[0].text
    whole = (
        client.completions.create(
            model=live_stack.model_name, prompt=PROMPT, max_tokens=3, logprobs=1, echo=True, temperature=0
        )
        .choices[0]
        .logprobs
    )
    assert chunks[1].choices[0].logprobs.text_offset == whole.text_offset[len(ids) : len(ids) + 1]


# ---------------------------------------------------------------- batched prompts

BATCH = ["the cat sat on the", "a small bird sang in the tree and", "the dog ran"]


def one_by_one(client, live_stack, prompts, **kwargs) -> list:
    return [client.completions.create(model=live_stack.model_name, prompt=p, **kwargs) for p in prompts]


@pytest.mark.parametrize("as_tokens", [False, True])
def test_a_batch_gives_one_choice_per_prompt_per_n_indexed_as_openai(client, live_stack, hf, as_tokens):
    prompts = [hf[0].encode(p) for p in BATCH] if as_tokens else BATCH
    alone = one_by_one(client, live_stack, prompts, max_tokens=5, temperature=0, extra_body={"ignore_eos": True})
    batch = client.completions.create(
        model=live_stack.model_name, prompt=prompts, n=2, extra_body={"ignore_eos": True}, max_tokens=5, temperature=0
    )
    assert [c.index for c in batch.choices] == list(range(2 * len(BATCH)))
    for choice in batch.choices:
        assert choice.text == alone[choice.index // 2].choices[0].text and choice.finish_reason == "length"
    assert batch.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone)
    assert batch.usage.completion_tokens == 2 * sum(a.usage.completion_tokens for a in alone)


def test_a_batch_of_echoed_prompts_carries_each_prompts_logprobs(client, live_stack, hf):
    """lm-eval's loglikelihood request, batched: max_tokens 0, echo, logprobs, token prompts."""
    prompts = [hf[0].encode(p) for p in BATCH]
    batch = client.completions.create(model=live_stack.model_name, prompt=prompts, max_tokens=0, echo=True, logprobs=1)
    for choice, ids in zip(batch.choices, prompts):
        assert choice.text == hf[0].decode(ids)
        assert choice.logprobs.token_logprobs[1:] == pytest.approx(hf_prompt_logprobs(hf, ids), abs=1e-3)


def test_a_streamed_batch_gives_every_choice_its_text_and_finish(client, live_stack):
    alone = one_by_one(client, live_stack, BATCH, max_tokens=4, temperature=0)
    chunks = list(
        client.completions.create(
            model=live_stack.model_name,
            prompt=BATCH,
            max_tokens=4,
            temperature=0,
            echo=True,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    texts, finished = {}, {}
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
            if choice.finish_reason:
                finished[choice.index] = choice.finish_reason
    assert texts == {i: BATCH[i] + a.choices[0].text for i, a in enumerate(alone)}
    assert set(finished) == set(range(len(BATCH)))
    assert chunks[-1].usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone)


@pytest.mark.parametrize("prompt", [[], [[]], ["ok", ""], ["ok", [1, 2]], [[1, -2]], ["x"] * 257])
def test_bad_batches_are_400_on_prompt(client, live_stack, prompt):
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=live_stack.model_name, prompt=prompt, max_tokens=1)
    assert caught.value.body["param"] == "prompt"


@pytest.mark.parametrize("prompt, param", [([5, 10**12], "prompt"), ([[5, 6], [5, 512]], "prompt[1]")])
def test_token_prompts_outside_the_vocabulary_are_400(client, live_stack, prompt, param):
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=live_stack.model_name, prompt=prompt, max_tokens=1, echo=True)
    assert caught.value.body["param"] == param


def test_a_batch_is_refused_whole_when_one_prompt_is_too_long(client, live_stack):
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=live_stack.model_name, prompt=[[5] * 4, [5] * 600], max_tokens=1)
    assert caught.value.body["code"] == "context_length_exceeded"


def test_a_batch_job_line_takes_one_prompt(tiny_model_dir):
    from batches.lines import build_call
    from errors import ServiceError

    models = {"tiny": {"model_path": tiny_model_dir, "max_model_len": 512}}
    assert build_call("/v1/completions", {"model": "tiny", "prompt": ["one"], "echo": True}, models=models).gen.prompts
    with pytest.raises(ServiceError) as caught:
        build_call("/v1/completions", {"model": "tiny", "prompt": ["one", "two"]}, models=models)
    assert caught.value.param == "prompt"


# ---------------------------------------------------------------- vLLM's tokenizer routes


def test_tokenize_and_detokenize_use_the_models_tokenizer(live_stack, hf):
    tok = hf[0]
    body = post(
        live_stack, "/tokenize", {"prompt": PROMPT, "add_special_tokens": False, "return_token_strs": True}
    ).json()
    assert body["tokens"] == tok.encode(PROMPT, add_special_tokens=False) and body["count"] == len(body["tokens"])
    assert body["token_strs"] == tok.convert_ids_to_tokens(body["tokens"]) and body["max_model_len"] == 512
    with_bos = post(live_stack, "/tokenize", {"model": live_stack.model_name, "prompt": PROMPT}).json()
    assert with_bos["tokens"] == tok.encode(PROMPT) and with_bos["token_strs"] is None
    assert post(live_stack, "/detokenize", {"tokens": body["tokens"]}).json() == {"prompt": tok.decode(body["tokens"])}


def test_tokenize_renders_chat_messages_with_the_template(live_stack, hf):
    messages = [{"role": "user", "content": "hello there"}]
    body = post(live_stack, "/tokenize", {"messages": messages}).json()
    text = hf[0].apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert body["tokens"] == hf[0].encode(text, add_special_tokens=False)


def test_tokenizer_info_names_the_special_tokens(live_stack, hf):
    body = post(live_stack, "/tokenizer_info").json()
    assert (body["eos_token"], body["bos_token"], body["pad_token"]) == (
        hf[0].eos_token,
        hf[0].bos_token,
        hf[0].pad_token,
    )
    assert body["tokenizer_class"] and body["chat_template"] == hf[0].chat_template


@pytest.mark.parametrize(
    "route, body, status, param",
    [
        ("/tokenize", {"prompt": PROMPT}, 401, None),
        ("/tokenize", {}, 400, "prompt"),
        ("/tokenize", {"prompt": "x", "model": "no-such-model"}, 404, "model"),
        ("/detokenize", {"tokens": [1, 10**9]}, 400, "tokens[1]"),
        ("/detokenize", {"tokens": "abc"}, 400, "tokens"),
    ],
)
def test_tokenizer_routes_refuse_with_the_error_envelope(live_stack, route, body, status, param):
    response = post(live_stack, route, body, key=None if status == 401 else "default")
    assert response.status_code == status
    assert response.json()["error"]["param"] == param
