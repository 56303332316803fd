"""Repetition, presence and frequency penalties against references computed outside the engine.

The reference runs HF transformers' model on the engine's own tokens, applies HF's
RepetitionPenaltyLogitsProcessor (repetition, over prompt and output) and OpenAI's formula
(logit -= frequency * count + presence * [count > 0], over the output only), then picks the token:
argmax when greedy; when sampling, the documented draw argmax(softmax(logits / T) / q) with
q ~ Exp(1) from a generator seeded like the request (sequence i of n uses seed + i).
"""

import pytest
import torch
from transformers import RepetitionPenaltyLogitsProcessor

from inference import SamplingParams

PROMPT = [11, 12, 13, 11, 12, 13, 11, 12]  # repeats itself, so the penalties have something to bite
MAX_TOKENS = 12
PENALTIES = {
    "repetition": dict(repetition_penalty=1.6),
    "presence": dict(presence_penalty=1.5),
    "frequency": dict(frequency_penalty=1.2),
    "combined": dict(repetition_penalty=1.3, presence_penalty=0.8, frequency_penalty=-0.4),
}


def reference_logits(
    tiny_hf_model, prompt: list[int], output: list[int], penalties: dict
) -> tuple[torch.Tensor, torch.Tensor]:
    """(raw logprobs, penalized logits) of the next token after prompt + output."""
    ids = torch.tensor([prompt + output])
    with torch.no_grad():
        raw = tiny_hf_model(ids).logits[0, -1].float()
    logits = raw.clone()[None]
    if penalties.get("repetition_penalty", 1.0) != 1.0:
        logits = RepetitionPenaltyLogitsProcessor(penalties["repetition_penalty"])(ids, logits)
    counts = torch.bincount(torch.tensor(output, dtype=torch.long), minlength=logits.shape[-1]).float()
    logits = (
        logits[0]
        - penalties.get("frequency_penalty", 0.0) * counts
        - penalties.get("presence_penalty", 0.0) * (counts > 0).float()
    )
    return torch.log_softmax(raw, dim=-1), logits


def check_against_reference(tiny_hf_model, prompt, tokens, penalties, temperature=0.0, seed=None):
    generator = None
    if seed is not None:
        generator = torch.Generator().manual_seed(seed)
    for step, token in enumerate(tokens):
        _, logits = reference_logits(tiny_hf_model, prompt, tokens[:step], penalties)
        if temperature == 0:
            expected = int(logits.argmax())
        else:
            probs = torch.softmax(logits / temperature, dim=-1)
            expected = int((probs / torch.empty_like(probs).exponential_(generator=generator)).argmax())
        assert token == expected, f"step {step}: engine {token}, reference {expected}"


def generate(tiny_llm, **params):
    params = dict(max_tokens=MAX_TOKENS, ignore_eos=True) | params
    return tiny_llm.generate(prompt_token_ids=[PROMPT], sampling_params=SamplingParams(**params), use_tqdm=False)[0]


@pytest.mark.parametrize("name", PENALTIES)
def test_greedy_penalties_match_the_reference(tiny_llm, tiny_hf_model, name):
    penalties = PENALTIES[name]
    out = generate(tiny_llm, temperature=0.0, **penalties)
    assert out.error is None
    tokens = out.outputs[0].token_ids
    assert len(tokens) == MAX_TOKENS
    check_against_reference(tiny_hf_model, PROMPT, tokens, penalties)
    assert tokens != generate(tiny_llm, temperature=0.0).outputs[0].token_ids  # the penalty changed something


@pytest.mark.parametrize("name", PENALTIES)
def test_sampled_penalties_match_the_reference(tiny_llm, tiny_hf_model, name):
    penalties = PENALTIES[name]
    out = generate(tiny_llm, temperature=0.1, seed=7, **penalties)
    check_against_reference(tiny_hf_model, PROMPT, out.outputs[0].token_ids, penalties, temperature=0.1, seed=7)
    assert out.outputs[0].token_ids != generate(tiny_llm, temperature=0.1, seed=7).outputs[0].token_ids


def test_repetition_penalty_greedy_equals_hf_generate(tiny_llm, tiny_hf_model):
    """HF's own generate() with repetition_penalty is the end-to-end reference for greedy."""
    tiny_hf_model.generation_config.eos_token_id = None
    with torch.no_grad():
        expected = tiny_hf_model.generate(
            torch.tensor([PROMPT]),
            do_sample=False,
            max_new_tokens=MAX_TOKENS,
            repetition_penalty=1.6,
            attention_mask=torch.ones(1, len(PROMPT), dtype=torch.long),
        )
    out = generate(tiny_llm, temperature=0.0, repetition_penalty=1.6)
    assert out.outputs[0].token_ids == expected[0, len(PROMPT) :].tolist()


@pytest.mark.parametrize("temperature", [0.0, 0.1])
def test_n_forks_each_keep_their_own_penalty_history(tiny_llm, tiny_hf_model, temperature):
    penalties = PENALTIES["combined"]
    out = generate(tiny_llm, n=3, temperature=temperature, seed=21, **penalties)
    assert [c.index for c in out.outputs] == [0, 1, 2]
    for completion in out.outputs:
        assert completion.finish_reason == "length"
        check_against_reference(
            tiny_hf_model, PROMPT, completion.token_ids, penalties, temperature, seed=21 + completion.index
        )
    if temperature:  # sequence i reproduces a single request with seed + i
        alone = generate(tiny_llm, temperature=temperature, seed=22, **penalties)
        assert out.outputs[1].token_ids == alone.outputs[0].token_ids


@pytest.mark.parametrize("temperature", [0.0, 0.1])
def test_logprobs_with_penalties_are_the_models_raw_logprobs(tiny_llm, tiny_hf_model, temperature):
    """As in vLLM, logprobs describe the model's distribution, before penalties and temperature."""
    penalties = PENALTIES["combined"]
    out = generate(tiny_llm, temperature=temperature, seed=3, logprobs=3, prompt_logprobs=1, **penalties)
    completion = out.outputs[0]
    check_against_reference(tiny_hf_model, PROMPT, completion.token_ids, penalties, temperature, seed=3)
    for step, token in enumerate(completion.token_ids):
        raw, _ = reference_logits(tiny_hf_model, PROMPT, completion.token_ids[:step], penalties)
        entry = completion.logprobs[step]
        assert entry[token].logprob == pytest.approx(raw[token].item(), abs=1e-4)
        top = sorted((lp for lp in entry.values() if lp.rank <= 3), key=lambda lp: lp.rank)
        assert [lp.logprob for lp in top] == pytest.approx(raw.topk(3).values.tolist(), abs=1e-4)
    assert len(out.prompt_logprobs) == len(PROMPT)


def test_penalized_request_shares_a_batch_with_plain_ones(tiny_llm):
    """The issue's failure: one penalized request in a batch failed every request of the step."""
    plain = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    alone = tiny_llm.generate(prompt_token_ids=[PROMPT], sampling_params=plain, use_tqdm=False)[0]
    mixed = tiny_llm.generate(
        prompt_token_ids=[PROMPT] * 4,
        use_tqdm=False,
        sampling_params=[
            plain,
            SamplingParams(temperature=0.1, max_tokens=MAX_TOKENS, ignore_eos=True, frequency_penalty=0.5),
            plain,
            SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, presence_penalty=1.0),
        ],
    )
    assert all(out.error is None for out in mixed)
    assert [mixed[0].outputs[0].token_ids, mixed[2].outputs[0].token_ids] == [alone.outputs[0].token_ids] * 2
