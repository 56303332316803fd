"""Greedy outputs of our engine equal HF transformers token for token (fp32, same weights).

Also under the conditions where bookkeeping bugs hide: a pool so small that requests wait and
get preempted, a tiny token budget (chunked prefill), prefix-cache hits and n > 1 forks.
"""

import random

import pytest
from tiny_models import hf_greedy

from inference import LLM, SamplingParams

FAMILIES = ["llama", "llama3", "mistral", "qwen2", "phi3", "gemma"]


def prompts_of_lengths(lengths, seed=0, vocab=500):
    rng = random.Random(seed)
    return [[rng.randrange(10, vocab) for _ in range(n)] for n in lengths]


def greedy(max_tokens):
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def engine_outputs(model_dir, prompts, max_tokens, **engine_args):
    engine_args.setdefault("max_model_len", 512)
    llm = LLM(model=model_dir, dtype="float32", **engine_args)
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=greedy(max_tokens), use_tqdm=False)
    return llm, [o.outputs[0].token_ids for o in outs]


def assert_no_leak(llm):
    stats = llm.llm_engine.get_stats()
    assert stats["blocks_used"] == 0, stats
    assert all(b.ref_cnt == 0 for b in llm.llm_engine.kv.pool.blocks)


@pytest.mark.parametrize("family", FAMILIES)
def test_batch_of_very_different_lengths_matches_hf(model_factory, family):
    model_dir = model_factory(family)
    prompts = prompts_of_lengths([1, 7, 16, 17, 63, 200, 333])
    llm, ours = engine_outputs(model_dir, prompts, 24)
    assert ours == hf_greedy(model_dir, prompts, 24)
    assert_no_leak(llm)


def test_tiny_pool_forces_waiting_and_preemption(model_factory):
    model_dir = model_factory("llama")
    prompts = prompts_of_lengths([40, 90, 25, 120, 60, 33], seed=1)
    # 24 blocks of 16 = 384 slots: far less than the 6 requests need together.
    llm, ours = engine_outputs(model_dir, prompts, 40, num_kv_blocks=24, block_size=16, max_model_len=256)
    assert llm.llm_engine.scheduler.num_preemptions > 0
    assert ours == hf_greedy(model_dir, prompts, 40)
    assert_no_leak(llm)


def test_small_token_budget_chunks_prefill(model_factory):
    model_dir = model_factory("qwen2")
    prompts = prompts_of_lengths([150, 3, 77, 40], seed=2)
    llm, ours = engine_outputs(model_dir, prompts, 20, max_num_batched_tokens=16)
    assert ours == hf_greedy(model_dir, prompts, 20)
    assert_no_leak(llm)


def test_prefix_cache_hit_computes_only_the_suffix(model_factory):
    model_dir = model_factory("llama")
    prefix = prompts_of_lengths([100], seed=3)[0]
    first, second = prefix + [11, 12, 13], prefix + [21, 22, 23, 24, 25]
    llm = LLM(model=model_dir, dtype="float32", max_model_len=512, block_size=16)
    out1 = llm.generate(prompt_token_ids=[first], sampling_params=greedy(16), use_tqdm=False)[0]
    before = llm.llm_engine.metrics.prompt_tokens_total
    out2 = llm.generate(prompt_token_ids=[second], sampling_params=greedy(16), use_tqdm=False)[0]
    computed = llm.llm_engine.metrics.prompt_tokens_total - before
    assert out2.num_cached_tokens == 96  # the 6 full blocks of the shared prefix
    assert computed == len(second) - 96
    assert [out1.outputs[0].token_ids, out2.outputs[0].token_ids] == hf_greedy(model_dir, [first, second], 16)
    assert llm.llm_engine.get_stats()["prefix_cache_hit_rate"] > 0


def test_prefix_cache_hits_after_preemption_stay_exact(model_factory):
    model_dir = model_factory("mistral")
    shared = prompts_of_lengths([64], seed=4)[0]
    prompts = [shared + p for p in prompts_of_lengths([5, 30, 50, 12], seed=5)]
    llm, ours = engine_outputs(model_dir, prompts, 48, num_kv_blocks=22, block_size=8, max_model_len=176)
    assert llm.llm_engine.scheduler.num_preemptions > 0
    assert ours == hf_greedy(model_dir, prompts, 48)
    assert_no_leak(llm)


def test_n_forks_equal_separate_seeded_requests(model_factory):
    model_dir = model_factory("llama")
    prompt = prompts_of_lengths([21], seed=6)[0]  # 21 tokens: the last block is shared and partial
    llm = LLM(model=model_dir, dtype="float32", max_model_len=256, block_size=16)
    sampled = dict(temperature=0.9, top_p=0.95, max_tokens=20, ignore_eos=True)
    forked = llm.generate(
        prompt_token_ids=[prompt], sampling_params=SamplingParams(n=3, seed=7, **sampled), use_tqdm=False
    )[0]
    separate = llm.generate(
        prompt_token_ids=[prompt] * 3,
        use_tqdm=False,
        sampling_params=[SamplingParams(seed=7 + i, **sampled) for i in range(3)],
    )
    assert [o.index for o in forked.outputs] == [0, 1, 2]
    assert [o.token_ids for o in forked.outputs] == [s.outputs[0].token_ids for s in separate]
    assert len({tuple(o.token_ids) for o in forked.outputs}) > 1  # really different samples
    assert_no_leak(llm)


def test_n_greedy_forks_copy_on_write(model_factory):
    model_dir = model_factory("llama")
    prompt = prompts_of_lengths([21], seed=8)[0]
    llm = LLM(model=model_dir, dtype="float32", max_model_len=256, block_size=16)
    engine = llm.llm_engine
    engine.add_request(
        "r", {"prompt_token_ids": prompt}, SamplingParams(n=2, temperature=0, max_tokens=8, ignore_eos=True)
    )
    engine.step()  # prefill, then the fork: both sequences hold the prompt's two blocks
    seqs = engine.requests["r"].group
    assert len(seqs) == 2
    assert [b.ref_cnt for b in engine.kv.tables[seqs[0]]] == [2, 2]
    plan_copies = []
    original = engine.runner.copy_blocks
    engine.runner.copy_blocks = lambda copies: (plan_copies.extend(copies), original(copies))
    while engine.has_unfinished_requests():
        final = engine.step()
    assert len(plan_copies) == 1  # the shared partial block was copied once, on first write
    expected = hf_greedy(model_dir, [prompt], 8)[0]
    assert [o.token_ids for o in final[0].outputs] == [expected, expected]
    assert engine.get_stats()["blocks_used"] == 0


def test_low_priority_request_is_preempted_and_still_exact(model_factory):
    model_dir = model_factory("llama")
    long_prompt, *short_prompts = prompts_of_lengths([150, 20, 25, 30], seed=9)
    llm = LLM(model=model_dir, dtype="float32", max_model_len=256, block_size=16, num_kv_blocks=16)
    engine = llm.llm_engine
    engine.add_request("low", {"prompt_token_ids": long_prompt}, greedy(60), priority=5)
    for _ in range(3):
        engine.step()
    for i, p in enumerate(short_prompts):
        engine.add_request(f"high{i}", {"prompt_token_ids": p}, greedy(30), priority=0)
    finish_order, outputs = [], {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finish_order.append(out.request_id)
                outputs[out.request_id] = out.outputs[0].token_ids
    assert finish_order[-1] == "low"
    assert engine.requests == {}
    low_metrics = engine.scheduler.num_preemptions
    assert low_metrics >= 1
    expected = hf_greedy(model_dir, [long_prompt, *short_prompts], [60, 30, 30, 30])
    assert [outputs["low"], outputs["high0"], outputs["high1"], outputs["high2"]] == expected


@pytest.mark.parametrize(
    "bad, message",
    [
        ({"prompt_token_ids": []}, "empty"),
        ({"prompt_token_ids": [5] * 600}, "max_model_len"),
        ({"prompt_token_ids": [10**6]}, "out of range"),
    ],
)
def test_bad_prompts_raise_and_leave_the_batch_alone(tiny_model_dir, bad, message):
    llm = LLM(model=tiny_model_dir, dtype="float32", max_model_len=512)
    with pytest.raises(ValueError, match=message):
        llm.generate([{"prompt_token_ids": [5, 6, 7]}, bad], greedy(4), use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()
    out = llm.generate(prompt_token_ids=[[5, 6, 7]], sampling_params=greedy(4), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(max_tokens=0), "max_tokens"),
        (dict(temperature=-1), "temperature"),
        (dict(top_p=0), "top_p"),
        (dict(top_k=-5), "top_k"),
    ],
)
def test_bad_sampling_values_raise(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_unknown_sampling_argument_raises():
    with pytest.raises(TypeError):
        SamplingParams(temprature=0.5)


def test_text_prompts_and_eos(tiny_model_dir):
    llm = LLM(model=tiny_model_dir, dtype="float32", max_model_len=512)
    out = llm.generate(["The assert statement"], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)[0]
    tok = llm.get_tokenizer()
    assert out.prompt_token_ids == tok.encode("The assert statement")
    assert out.outputs[0].finish_reason in ("stop", "length")
    assert out.outputs[0].text == tok.decode(
        [t for t in out.outputs[0].token_ids if t not in tok.all_special_ids], skip_special_tokens=True
    )
