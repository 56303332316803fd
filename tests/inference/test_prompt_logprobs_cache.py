"""A request that asks for prompt logprobs computes every prompt position: it bypasses prefix-cache hits
(a hit would skip the positions whose logits it needs), while other requests keep hitting the cache."""

import pytest
import torch

from inference import LLM, SamplingParams

BLOCK = 16
PROMPT = [(5 * i) % 300 + 20 for i in range(3 * BLOCK + 5)]  # three full blocks and a tail


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    return LLM(model=tiny_model_dir, dtype="float32", max_model_len=256, block_size=BLOCK, enable_prefix_caching=True)


@pytest.fixture(scope="module")
def hf_logprobs(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([PROMPT])).logits[0].float(), dim=-1)


def run(llm, **params):
    return llm.generate(
        prompt_token_ids=[PROMPT], use_tqdm=False, sampling_params=SamplingParams(temperature=0, max_tokens=1, **params)
    )[0]


def test_prompt_logprobs_bypass_a_warm_prefix_cache(llm, hf_logprobs):
    run(llm)  # fills the prefix cache with the prompt's full blocks
    assert run(llm).num_cached_tokens == 3 * BLOCK  # a plain request hits it

    out = run(llm, prompt_logprobs=1)
    assert out.num_cached_tokens == 0
    assert len(out.prompt_logprobs) == len(PROMPT) and out.prompt_logprobs[0] is None
    for position in range(1, len(PROMPT)):
        token = PROMPT[position]
        assert out.prompt_logprobs[position][token].logprob == pytest.approx(
            hf_logprobs[position - 1, token].item(), abs=1e-4
        )

    assert run(llm).num_cached_tokens == 3 * BLOCK  # the cache is still there for everyone else


def test_prompt_logprobs_survive_a_preemption_mid_prefill(tiny_model_dir, hf_logprobs):
    """Recompute preemption runs the prompt again: its logprobs are recorded once per position."""
    llm = LLM(
        model=tiny_model_dir,
        dtype="float32",
        max_model_len=128,
        block_size=BLOCK,
        num_kv_blocks=8,
        max_num_batched_tokens=16,
    )
    engine = llm.llm_engine
    engine.add_request(
        "low",
        {"prompt_token_ids": PROMPT},
        SamplingParams(temperature=0, max_tokens=30, prompt_logprobs=1, ignore_eos=True),
        priority=5,
    )
    engine.step()  # the first 16-token chunk of its prefill
    engine.add_request(
        "high",
        {"prompt_token_ids": PROMPT[:40][::-1]},
        SamplingParams(temperature=0, max_tokens=60, ignore_eos=True),
        priority=0,
    )
    outputs = {}
    while engine.has_unfinished_requests():
        outputs.update({out.request_id: out for out in engine.step() if out.finished})
    assert engine.scheduler.num_preemptions >= 1
    low = outputs["low"].prompt_logprobs
    assert len(low) == len(PROMPT)
    for position in range(1, len(PROMPT)):
        token = PROMPT[position]
        assert low[position][token].logprob == pytest.approx(hf_logprobs[position - 1, token].item(), abs=1e-4)
