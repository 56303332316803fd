"""/v1/completions echo with prompt logprobs (against HF transformers), max_tokens 0, streamed echo, and
vLLM's /tokenize, /detokenize and /tokenizer_info, on the live stack with the official openai client."""
from __future__ import annotations

import openai
import pytest
import requests
import torch

PROMPT = "the cat sat on the mat and the dog ran in the park"


@pytest.fixture(scope="module")
def hf(tiny_model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return (AutoTokenizer.from_pretrained(tiny_model_dir),
            AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval())


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
    out = client.completions.create(model=live_stack.model_name, prompt=PROMPT, max_tokens=1, logprobs=1,
                                    echo=True, temperature=0)
    plain = client.completions.create(model=live_stack.model_name, prompt=PROMPT, max_tokens=1, temperature=0)
    choice = out.choices[0]
    assert choice.text == PROMPT + plain.choices[0].text
    lp = choice.logprobs
    assert len(lp.tokens) == len(ids) + 1 == out.usage.prompt_tokens + out.usage.completion_tokens
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[1:len(ids)] == pytest.approx(hf_prompt_logprobs(hf, ids), abs=1e-3)
    assert [hf[0].convert_tokens_to_string([t]) for t in hf[0].convert_ids_to_tokens(ids[1:])] == lp.tokens[1:len(ids)]
    assert all(len(top) >= 1 for top in lp.top_logprobs[1:])
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0


def test_echo_twice_still_computes_every_prompt_position(client, live_stack, hf):
    """The second request would hit the first one's prefix-cache blocks; prompt logprobs bypass them."""
    prompt = " ".join([PROMPT] * 4)
    answers = [client.completions.create(model=live_stack.model_name, prompt=prompt, max_tokens=1, logprobs=0,
                                         echo=True, temperature=0) for _ in range(2)]
    expected = hf_prompt_logprobs(hf, hf[0].encode(prompt))
    for out in answers:
        assert out.usage.prompt_tokens_details.cached_tokens == 0
        assert out.choices[0].logprobs.token_logprobs[1:len(expected) + 1] == pytest.approx(expected, abs=1e-3)


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
    echoed = client.completions.create(model=live_stack.model_name, prompt=PROMPT, max_tokens=4, temperature=0,
                                       echo=True)
    assert echoed.choices[0].text == PROMPT + plain.choices[0].text and echoed.choices[0].logprobs is None


def test_streamed_echo_opens_with_the_prompt_and_its_logprobs(client, live_stack, hf):
    ids = hf[0].encode(PROMPT)
    chunks = list(client.completions.create(model=live_stack.model_name, prompt=PROMPT, max_tokens=3, logprobs=1,
                                            echo=True, temperature=0, stream=True))
    plain = client.completions.create(model=live_stack.model_name, prompt=PROMPT, max_tokens=3, temperature=0)
    first = chunks[0].choices[0]
    assert first.text == PROMPT and first.logprobs.token_logprobs[0] is None
    assert first.logprobs.token_logprobs[1:] == pytest.approx(hf_prompt_logprobs(hf, ids), abs=1e-3)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == PROMPT + plain.choices[0].text
    whole = client.completions.create(model=live_stack.model_name, prompt=PROMPT, max_tokens=3, logprobs=1,
                                      echo=True, temperature=0).choices[0].logprobs
    assert chunks[1].choices[0].logprobs.text_offset == whole.text_offset[len(ids):len(ids) + 1]


# ---------------------------------------------------------------- vLLM's tokenizer routes

def test_tokenize_and_detokenize_use_the_models_tokenizer(live_stack, hf):
    tok = hf[0]
    body = post(live_stack, "/tokenize", {"prompt": PROMPT, "add_special_tokens": False,
                                          "return_token_strs": True}).json()
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
    assert (body["eos_token"], body["bos_token"], body["pad_token"]) == (hf[0].eos_token, hf[0].bos_token,
                                                                         hf[0].pad_token)
    assert body["tokenizer_class"] and body["chat_template"] == hf[0].chat_template


@pytest.mark.parametrize("route, body, status, param", [
    ("/tokenize", {"prompt": PROMPT}, 401, None),
    ("/tokenize", {}, 400, "prompt"),
    ("/tokenize", {"prompt": "x", "model": "no-such-model"}, 404, "model"),
    ("/detokenize", {"tokens": [1, 10 ** 9]}, 400, "tokens[1]"),
    ("/detokenize", {"tokens": "abc"}, 400, "tokens"),
])
def test_tokenizer_routes_refuse_with_the_error_envelope(live_stack, route, body, status, param):
    response = post(live_stack, route, body, key=None if status == 401 else "default")
    assert response.status_code == status
    assert response.json()["error"]["param"] == param
