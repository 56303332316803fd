"""The whole stack serving the real default model (SmolLM2-135M-Instruct GGUF, MODEL unset): the
official openai client at temperature 0 gets HF transformers' greedy answer token for token."""

from __future__ import annotations

import openai
import pytest
import torch

from inference.gguf_files import bundled_model
from tests.platform.live_stack import real_model_stack

pytestmark = pytest.mark.slow
QUESTIONS = ["What is the capital of France?", "Name three primary colors."]
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    with real_model_stack(tmp_path_factory, "real-stack", {"max_model_len": 512, "num_kv_blocks": 64}) as live:
        yield live


@pytest.fixture(scope="module")
def client(stack):
    return openai.OpenAI(base_url=stack.base_url + "/v1", api_key=stack.api_key, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def hf_answers():
    """HF transformers on the same GGUF file: greedy, stopping on <|im_end|> (the model's EOS)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    file = bundled_model()
    tokenizer = AutoTokenizer.from_pretrained(file.parent, gguf_file=file.name)
    model = AutoModelForCausalLM.from_pretrained(file.parent, gguf_file=file.name, dtype=torch.float32).eval()
    answers = []
    for question in QUESTIONS:
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=True, return_dict=False
        )
        with torch.no_grad():
            out = model.generate(
                torch.tensor([ids]),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                max_new_tokens=MAX_TOKENS,
                do_sample=False,
            )
        tokens = out[0, len(ids) :].tolist()
        answers.append((len(ids), tokens, tokenizer.decode(tokens, skip_special_tokens=True)))
    return answers


def test_the_default_model_is_served_under_its_own_name(client):
    assert [m.id for m in client.models.list()] == ["SmolLM2-135M-Instruct"]


@pytest.mark.parametrize("index", range(len(QUESTIONS)))
def test_chat_at_temperature_0_equals_hf_transformers(client, hf_answers, index):
    prompt_tokens, tokens, text = hf_answers[index]
    messages = [{"role": "user", "content": QUESTIONS[index]}]
    reply = client.chat.completions.create(
        model="SmolLM2-135M-Instruct", messages=messages, temperature=0, max_tokens=MAX_TOKENS
    )
    assert reply.choices[0].message.content == text
    assert reply.usage.prompt_tokens == prompt_tokens and reply.usage.completion_tokens == len(tokens)
    assert reply.choices[0].finish_reason == ("stop" if len(tokens) < MAX_TOKENS else "length")
    chunks = client.chat.completions.create(
        model="SmolLM2-135M-Instruct", messages=messages, temperature=0, max_tokens=MAX_TOKENS, stream=True
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
