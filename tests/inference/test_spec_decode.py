"""Speculative decoding: outputs equal to plain decoding (and HF) whatever is proposed, blocks returned,
start-up errors that name the field, the opt-out, and the rejection rule's output distribution."""

import json
import random
import time

import pytest
import torch
from test_gguf import write_gguf
from tiny_models import chosen_logprobs, hf_greedy, make_tiny_model

from inference import LLM, SamplingParams
from inference.engine_setup import weight_bytes
from inference.loader import load_tokenizer
from inference.metrics import EngineMetrics
from inference.request import Request
from inference.sampler import Sampler
from inference.spec_decode import speculator
from inference.spec_decode.config import SpeculativeConfig
from inference.spec_decode.ngram import NgramProposer, ngram_proposal
from inference.spec_decode.rejection_sampler import DraftedRow, RejectionSampler
from inference.spec_decode.speculator import (
    MEASURED_WEIGHT,
    MIN_SPEEDUP,
    STALE_AFTER,
    StepCosts,
    best_k,
    step_cost,
)
from inference.structured_output import GrammarCompiler, StructuredOutputs, grammar_prefix
from tessera_kernels import quant_cpu

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


def draft_of(model_dir):
    """The model drafting for itself: every proposal accepted. Its weight bytes say speculation cannot pay
    (a draft as big as the target), so draft_cost 0 keeps it speculating for these checks."""
    return {"method": "draft_model", "num_speculative_tokens": 4, "model": model_dir, "draft_cost": 0}


def repetitive_prompts(seed=0):
    rng = random.Random(seed)
    base = [rng.randrange(10, 500) for _ in range(30)]
    return [base + base[:12], base * 3, [rng.randrange(10, 500) for _ in range(50)], base[:7]]


def speculate_every_step(monkeypatch) -> None:
    """k = num_speculative_tokens on every step, whatever the measured costs say: the checks below need
    proposals, and a busy machine's timings may turn speculation off."""
    monkeypatch.setattr(speculator, "best_k", lambda max_k, *args: max_k)
    monkeypatch.setattr(speculator.StepCosts, "needs_plain_timing", lambda self, batch_size: False)


def generate(llm, prompts, **params):
    params.setdefault("ignore_eos", True)
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=SamplingParams(**params), use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def assert_no_leak(llm):
    engine = llm.llm_engine
    assert engine.get_stats()["blocks_used"] == 0
    assert engine.kv.pool.num_free == engine.kv.pool.num_blocks


def test_ngram_proposal_prefers_the_longest_suffix_and_the_latest_match():
    assert ngram_proposal([1, 2, 3, 4, 5, 1, 2, 3], 3, 1, 3) == [4, 5, 1]
    assert ngram_proposal([1, 2, 9, 7, 2, 8, 2], 2, 1, 3) == [8, 2]  # latest earlier 2
    assert ngram_proposal([1, 2, 3, 4, 5, 9, 9, 7], 3, 1, 3) == []
    assert ngram_proposal([5, 6, 1, 6, 5, 6], 4, 2, 3) == [1, 6, 5, 6]


@pytest.mark.parametrize(
    "engine_args",
    [
        dict(max_num_batched_tokens=16),  # chunked prefill
        dict(num_kv_blocks=16, block_size=16, max_model_len=256),  # preemption in a tiny pool
        dict(),  # prefix-cache hits (prompts share a prefix)
    ],
    ids=["chunked", "tiny-pool", "prefix-cache"],
)
@pytest.mark.parametrize("method", ["ngram", "self-draft"])
def test_greedy_outputs_equal_plain_decoding_and_hf(tiny_model_dir, engine_args, method, monkeypatch):
    speculate_every_step(monkeypatch)
    engine_args = {"max_model_len": 512, **engine_args}
    prompts = repetitive_prompts()
    config = NGRAM if method == "ngram" else draft_of(tiny_model_dir)
    llm = LLM(model=tiny_model_dir, dtype="float32", speculative_config=config, **engine_args)
    expected = hf_greedy(tiny_model_dir, prompts, 60)
    assert generate(llm, prompts, temperature=0, max_tokens=60) == expected
    if not engine_args.get("num_kv_blocks") and "max_num_batched_tokens" not in engine_args:
        assert generate(llm, prompts, temperature=0, max_tokens=60) == expected  # now from the prefix cache
    stats = llm.llm_engine.get_stats()
    assert stats["spec_decode_num_drafts_total"] > 0
    if method == "self-draft":  # the target drafted by itself: every proposal is accepted
        assert stats["spec_decode_acceptance_rate"] == 1.0
        assert stats["spec_decode_mean_acceptance_length"] > 3
    if "num_kv_blocks" in engine_args:
        assert llm.llm_engine.scheduler.num_preemptions > 0
    if not engine_args.get("num_kv_blocks") and "max_num_batched_tokens" not in engine_args:
        assert stats["prefix_cache_hits"] > 0
    assert_no_leak(llm)


@pytest.fixture(scope="module")
def plain(tiny_model_dir):
    return LLM(model=tiny_model_dir, dtype="float32", max_model_len=512)


@pytest.fixture(scope="module")
def self_drafted(tiny_model_dir):
    return LLM(model=tiny_model_dir, dtype="float32", max_model_len=512, speculative_config=draft_of(tiny_model_dir))


def test_seeded_sampling_n_and_logprobs_equal_plain_decoding(plain, self_drafted):
    prompts = repetitive_prompts(1)
    params = SamplingParams(temperature=0.8, top_k=40, seed=7, n=2, max_tokens=40, ignore_eos=True, logprobs=2)
    a = plain.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    b = self_drafted.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    for x, y in zip(a, b):
        for cx, cy in zip(x.outputs, y.outputs):
            assert cx.token_ids == cy.token_ids
            for ex, ey, token in zip(cx.logprobs, cy.logprobs, cx.token_ids):
                assert ey[token].logprob == pytest.approx(ex[token].logprob, abs=1e-4)
    assert self_drafted.llm_engine.get_stats()["spec_decode_num_accepted_tokens_total"] > 0


def test_greedy_speculation_scores_each_token_with_plain_decodings_bits(plain, tiny_model_dir, monkeypatch):
    """Verification lays its 1 + k rows out as one-token decodes, so every token is scored exactly as a
    plain decode step scores it: equal logprobs, not merely the same argmax (a real model's near ties
    would otherwise flip)."""
    speculate_every_step(monkeypatch)
    speculating = LLM(model=tiny_model_dir, dtype="float32", max_model_len=512, speculative_config=NGRAM)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=1)
    for prompt in repetitive_prompts(2)[:2]:  # one at a time: a plain step then holds one row
        [a] = plain.generate(prompt_token_ids=[prompt], sampling_params=params, use_tqdm=False)
        [b] = speculating.generate(prompt_token_ids=[prompt], sampling_params=params, use_tqdm=False)
        x, y = a.outputs[0], b.outputs[0]
        assert y.token_ids == x.token_ids
        assert chosen_logprobs(y) == chosen_logprobs(x)
    assert speculating.llm_engine.get_stats()["spec_decode_num_accepted_tokens_total"] > 0


def assert_packed_speculation_has_plain_bits(tmp_path, monkeypatch) -> LLM:
    """8 greedy sequences on a tiny packed GGUF file (32-value types), plain and then speculating on every
    step with k = 4 (drafted by the file itself): the same tokens, each with the same logprob bits.
    Returns the speculating LLM."""
    speculate_every_step(monkeypatch)
    model = make_tiny_model(tmp_path / "hf", "llama")
    file = str(write_gguf(model, tmp_path / "tiny.gguf", ("Q8_0", "Q4_1", "Q5_0")))
    prompts = repetitive_prompts(0) + repetitive_prompts(1)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=1)
    outputs = []
    for config in (None, draft_of(file)):
        llm = LLM(model=file, device="cpu", max_model_len=256, speculative_config=config)
        done = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
        outputs.append([o.outputs[0] for o in done])
    for x, y in zip(*outputs):
        assert y.token_ids == x.token_ids
        assert chosen_logprobs(y) == chosen_logprobs(x)
    return llm


def test_a_packed_batch_speculates_with_plain_decodings_bits(tmp_path, monkeypatch):
    """8 sequences verifying 4 proposals each would be 40 rows a step, past the 32 from which the 32-value GGUF
    types once changed to the bfloat16 path while plain decoding's 8 rows did not, so near ties flipped at
    batch 32 (docs/benchmarks.md). Interleaved rows keep the row-invariant integer kernel below AMX's tiles
    (at every count without them), and the speculator keeps a step below that crossover: every token scored
    with plain decoding's bits."""
    if not quant_cpu.kernel_kind("Q8_0").endswith(quant_cpu.X16):
        pytest.skip("no fused GGUF kernels on this CPU: its decoded path changes to bfloat16 at 32 rows")
    speculating = assert_packed_speculation_has_plain_bits(tmp_path, monkeypatch)
    stats = speculating.llm_engine.get_stats()
    assert stats["spec_decode_num_draft_tokens_total"] >= 8 * 4 * 4  # several steps of 8 x (1 + 4) rows


def test_verification_steps_stay_below_the_packed_linears_crossover(tmp_path, monkeypatch):
    """With the bfloat16 path taken from 12 rows, 8 sequences verifying 4 proposals each (40 rows) would score
    their tokens on it while plain decoding's 8 rows stay on the integer kernel; the speculator keeps every
    step below 12 rows instead, so tokens and logprobs keep plain decoding's bits."""
    monkeypatch.setattr(quant_cpu, "DEQUANTIZE_FROM_ROWS", 12)
    monkeypatch.setattr(quant_cpu, "TILES_FROM_ROWS", 12)
    step_rows = []
    propose = speculator.Speculator.propose

    def recording_propose(self, running):
        failed = propose(self, running)
        step_rows.append(len(running) + sum(len(seq.spec_token_ids) for seq in running))
        return failed

    monkeypatch.setattr(speculator.Speculator, "propose", recording_propose)
    speculating = assert_packed_speculation_has_plain_bits(tmp_path, monkeypatch)
    assert speculating.llm_engine.speculator.row_limit == 12
    assert speculating.llm_engine.get_stats()["spec_decode_num_draft_tokens_total"] > 0
    assert max(step_rows) == 11  # the spare rows used, never more


def test_stops_cut_the_accepted_tokens(plain, self_drafted):
    prompt = repetitive_prompts()[:1]
    free = generate(plain, prompt, temperature=0, max_tokens=40)[0]
    stop_token = free[13]
    first = free.index(stop_token)
    for llm in (plain, self_drafted):
        assert generate(llm, prompt, temperature=0, max_tokens=40, stop_token_ids=[stop_token])[0] == free[: first + 1]
        assert generate(llm, prompt, temperature=0, max_tokens=11)[0] == free[:11]
    text = (
        plain.generate(
            prompt_token_ids=prompt,
            use_tqdm=False,
            sampling_params=SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
        )[0]
        .outputs[0]
        .text
    )
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    cut = [
        llm.generate(
            prompt_token_ids=prompt,
            use_tqdm=False,
            sampling_params=SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=stop),
        )[0].outputs[0]
        for llm in (plain, self_drafted)
    ]
    assert cut[0].text == cut[1].text == text[: text.index(stop)]
    assert_no_leak(self_drafted)


def test_no_block_leak_over_thousands_of_steps(tiny_model_dir, monkeypatch):
    speculate_every_step(monkeypatch)
    llm = LLM(model=tiny_model_dir, dtype="float32", max_model_len=512, num_kv_blocks=40, speculative_config=NGRAM)
    engine = llm.llm_engine
    free_before = engine.kv.pool.num_free
    rng, steps, added = random.Random(3), 0, 0
    while steps < 2000:
        while engine.get_num_unfinished_requests() < 4:
            base = [rng.randrange(10, 500) for _ in range(rng.randrange(5, 40))]
            engine.add_request(
                f"r{added}",
                {"prompt_token_ids": base * 2},
                SamplingParams(temperature=rng.choice([0, 0.9]), max_tokens=rng.randrange(5, 120), ignore_eos=True),
            )
            added += 1
        engine.step()
        steps += 1
        for seq in engine.scheduler.running:  # never more blocks than its tokens need
            assert len(engine.kv.tables.get(seq, [])) <= engine.kv.blocks_needed(seq.num_tokens)
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.get_stats()["spec_decode_num_accepted_tokens_total"] > 0
    assert engine.kv.pool.num_free == free_before == engine.kv.pool.num_blocks


@pytest.mark.parametrize(
    "config, field",
    [
        ({"method": "medusa", "num_speculative_tokens": 2}, "speculative_config.method"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "speculative_config.num_speculative_tokens"),
        ({"method": "ngram"}, "speculative_config.num_speculative_tokens"),
        (
            {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
            "speculative_config.prompt_lookup_min",
        ),
        (
            {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": "3"},
            "speculative_config.prompt_lookup_max",
        ),
        ({"method": "draft_model", "num_speculative_tokens": 2}, "speculative_config.model"),
        ({"method": "ngram", "num_speculative_tokens": 2, "draft_cost": 0.1}, "speculative_config.draft_cost"),
        (
            {"method": "draft_model", "num_speculative_tokens": 2, "model": "m", "draft_cost": -1},
            "speculative_config.draft_cost",
        ),
        ({"method": "ngram", "num_speculative_tokens": 2, "lookahead": 1}, "lookahead"),
        ("{not json", "speculative_config"),
    ],
)
def test_bad_speculative_config_is_a_start_up_error_naming_the_field(tiny_model_dir, config, field):
    with pytest.raises(ValueError, match=field):
        LLM(model=tiny_model_dir, dtype="float32", speculative_config=config)


def test_a_draft_with_another_vocabulary_is_refused(tiny_model_dir, model_factory):
    other = model_factory("llama", vocab_size=300)
    with pytest.raises(ValueError, match="speculative_config.model .*vocab_size"):
        LLM(model=tiny_model_dir, dtype="float32", speculative_config=draft_of(other))


def test_opt_out_is_honoured(self_drafted, plain):
    engine = self_drafted.llm_engine
    before = engine.get_stats()["spec_decode_num_drafts_total"]
    prompts = repetitive_prompts()[:2]
    out = generate(self_drafted, prompts, temperature=0, max_tokens=30, speculative=False)
    assert engine.get_stats()["spec_decode_num_drafts_total"] == before
    assert out == generate(plain, prompts, temperature=0, max_tokens=30)
    with pytest.raises(ValueError, match="SamplingParams.speculative"):
        SamplingParams(speculative="no")


def test_a_failing_draft_model_fails_only_its_own_requests(tiny_model_dir, plain):
    llm = LLM(model=tiny_model_dir, dtype="float32", max_model_len=512, speculative_config=draft_of(tiny_model_dir))
    engine = llm.llm_engine
    proposer = engine.speculator.proposer
    runner_prepare = proposer.runner.prepare
    poisoned = 499  # the draft's forward raises for any sequence holding this token (a fault at its seam)

    def prepare(plan):
        if any(poisoned in draft.token_ids for draft in plan.scheduled):
            raise RuntimeError("draft forward broke")
        return runner_prepare(plan)

    proposer.runner.prepare = prepare
    prompts = repetitive_prompts()[:2] + [[5, 6, poisoned, 7]]
    outs = llm.generate(
        prompt_token_ids=prompts,
        use_tqdm=False,
        sampling_params=SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),
    )
    assert outs[2].outputs[0].finish_reason == "error" and "draft model" in outs[2].error
    assert [o.outputs[0].token_ids for o in outs[:2]] == generate(plain, prompts[:2], temperature=0, max_tokens=30)
    assert_no_leak(llm)


def test_adaptive_k_turns_speculation_down_with_batch_size_and_low_acceptance():
    model = StepCosts(0.0)  # nothing measured yet: the step-cost model
    assert best_k(4, 0.8, 1, model) == 4
    assert best_k(4, 0.01, 1, model) == 0
    assert best_k(4, 0.3, 256, model) == 0
    assert best_k(4, 0.8, 8, model) <= best_k(4, 0.8, 1, model)


def test_a_costly_draft_speculates_only_where_acceptance_pays_for_it():
    """Qwen2.5-Coder-0.5B drafting for 1.5B costs about 0.43 of a target step a token (their weight bytes)."""
    assert best_k(4, 0.42, 1, StepCosts(0.0)) > 0  # a free lookup still pays at open chat's acceptance
    assert best_k(4, 0.42, 1, StepCosts(0.43)) == 0  # the draft does not: plain decoding
    assert best_k(4, 0.93, 1, StepCosts(0.43)) == 4  # code editing's acceptance does
    assert best_k(4, 1.0, 1, StepCosts(1.0)) == 0  # a draft as big as the target never pays


def measured(step_ms: dict[int, float], proposal_ms: float | None = None, batch_size: int = 1) -> StepCosts:
    costs = StepCosts(0.43)
    for size, ms in step_ms.items():
        costs.observe_step(size, ms / 1000)
    if proposal_ms is not None:
        costs.observe_proposal(batch_size, 4, 4 * proposal_ms / 1000)
    return costs


def test_measured_step_times_replace_the_model_where_they_disagree():
    # the 1.5B/0.5B pair's open chat: verifying on the packed kernel costs far more than the model's 2% a row
    dear = measured({1: 107, 2: 175, 3: 190, 4: 205, 5: 220}, proposal_ms=47)
    slope = (1 * 68 + 2 * 83 + 3 * 98 + 4 * 113) / (1 + 4 + 9 + 16)  # ms a token: the line through the timings
    assert dear.step(2, 1) == pytest.approx(1 + slope / 107) and dear.step(5, 1) == pytest.approx(1 + 4 * slope / 107)
    assert dear.proposal(1) == pytest.approx(47 / 107)
    assert best_k(4, 0.66, 1, StepCosts(0.43)) > 0  # the model says it pays
    assert best_k(4, 0.66, 1, dear) == 0  # the timings say it does not: plain decoding
    # a draft measured cheaper than its weight bytes say pays where the model said it would not
    cheap = measured({1: 107, 2: 110, 3: 112, 4: 114, 5: 116}, proposal_ms=10)
    assert best_k(4, 0.42, 1, StepCosts(0.43)) == 0 and best_k(4, 0.42, 1, cheap) > 0


def test_sizes_not_yet_timed_cost_what_the_timed_ones_say():
    """SmolLM2 at batch 32 on the bfloat16 path: 124 ms plain, one 64-token verification step timed at 200 ms.
    A 96-token step then costs the line through them (2.23 plain steps), not the model's 1.79, so open chat's
    acceptance no longer buys k = 2 there; code editing's still speculates."""
    costs = StepCosts(0.0, max_k=5)
    costs.observe_step(32, 0.124)
    assert costs.step(96, 32) == pytest.approx(step_cost(96) / step_cost(32))  # nothing larger timed: the model
    assert best_k(5, 0.6, 32, costs) > 0
    costs.observe_step(64, 0.200)
    assert costs.step(96, 32) == pytest.approx(1 + 2 * 0.076 / 0.124)
    assert best_k(5, 0.6, 32, costs) == 0 and best_k(5, 0.85, 32, costs) > 0
    costs.observe_step(600, 9.0)  # beyond what batch 32 can reach at k <= 5: not on its line
    assert costs.step(96, 32) == pytest.approx(1 + 2 * 0.076 / 0.124)


def test_a_step_size_needs_a_fresh_plain_timing_and_a_stall_moves_the_average_boundedly():
    costs = StepCosts(0.0)
    assert costs.needs_plain_timing(1)
    costs.observe_step(1, 0.010)
    assert not costs.needs_plain_timing(1) and costs.needs_plain_timing(2)
    costs.observe_step(1, 1.0)  # a 100x stall counts as 2x
    assert costs.steps[1].seconds == pytest.approx(0.010 * (1 + MEASURED_WEIGHT))
    costs.observe_step(5, 0.050)
    assert costs.step(5, 1) == pytest.approx(0.050 / costs.steps[1].seconds)
    for _ in range(STALE_AFTER + 1):
        costs.observe_step(1, 0.010)
    assert costs.step(5, 1) == pytest.approx(1.08)  # not measured lately: the model again, so k = 4 is retried
    assert not costs.needs_plain_timing(1)
    costs.observe_step(2, 0.500)  # a cold first step
    for _ in range(4):
        costs.observe_step(2, 0.010)
    assert costs.steps[2].seconds < 0.050  # forgotten within a few


def test_a_configured_draft_cost_is_used_as_given_and_never_measured():
    costs = StepCosts(0.0, measure_proposals=False)
    costs.observe_step(1, 0.010)
    costs.observe_proposal(1, 4, 4.0)
    assert costs.proposal(1) == 0.0


def test_a_proposer_that_costs_more_than_it_saves_is_turned_off_by_its_timings(tiny_model_dir):
    """Proposing takes 0.1 s a token, many of the tiny model's plain steps: once a proposal is timed its
    measured cost says plain decoding for the rest of the request, and the outputs stay plain decoding's."""
    llm = LLM(model=tiny_model_dir, dtype="float32", max_model_len=256, speculative_config=NGRAM)
    proposer = llm.llm_engine.speculator.proposer
    fast, calls = proposer.propose, []

    def slow(seqs, ks):
        calls.append(ks)
        time.sleep(0.1 * max(ks))
        return fast(seqs, ks)

    proposer.propose = slow
    prompt = repetitive_prompts()[1]
    assert generate(llm, [prompt], temperature=0, max_tokens=40) == hf_greedy(tiny_model_dir, [prompt], 40)
    assert len(calls) == 1  # the first decode step ran plain (its timing), the next proposed, no other did
    assert llm.llm_engine.get_stats()["spec_decode_num_drafts_total"] <= 1
    assert llm.llm_engine.speculator.costs.proposal(1) > 1  # a proposed token costs more than a plain step


def test_a_drafts_catch_up_must_be_repaid_by_the_tokens_left():
    """The 1.5B/0.5B pair: a 188-token prompt the draft has not seen costs ~12 plain steps to catch up on.
    30 tokens to go cannot repay it at the speed-up code editing's acceptance buys; 2,000 can; a backlog
    dearer than the tokens left rules speculation out whatever the acceptance."""
    costs = StepCosts(0.43)
    assert costs.required_speedup(0, 96, 1) == MIN_SPEEDUP  # caught up: the usual threshold
    needed = costs.required_speedup(188, 30, 1)
    assert needed > 1.6
    assert best_k(4, 0.93, 1, costs) == 4 and best_k(4, 0.93, 1, costs, needed) == 0
    assert best_k(4, 0.93, 1, costs, costs.required_speedup(188, 2000, 1)) == 4
    assert costs.required_speedup(188, 5, 1) == float("inf")
    costs.observe_step(1, 0.035)
    costs.observe_catch_up(188, 0.460)  # measured: 2.4 ms a token, 0.07 of a plain step
    assert costs.catch_up(1) == pytest.approx(0.460 / 188 / 0.035)
    assert costs.required_speedup(188, 96, 1) == pytest.approx(96 / (96 - 0.460 / 0.035))


def test_a_draft_does_not_catch_up_on_a_long_prompt_for_a_short_answer(tiny_model_dir, plain):
    """A draft priced at 0.05 of a target step a token speculates on a short prompt, but catching up on a
    long one costs more plain steps than a 6-token answer can win back: that request decodes plainly."""
    config = {**draft_of(tiny_model_dir), "num_speculative_tokens": 2, "draft_cost": 0.05}
    llm = LLM(model=tiny_model_dir, dtype="float32", max_model_len=512, speculative_config=config)
    proposer = llm.llm_engine.speculator.proposer
    rng = random.Random(5)
    long_prompt = [rng.randrange(10, 500) for _ in range(400)]
    assert proposer.catch_up_tokens(Request("r", None, long_prompt, SamplingParams())) > 300
    assert generate(llm, [long_prompt], temperature=0, max_tokens=6) == generate(
        plain, [long_prompt], temperature=0, max_tokens=6
    )
    assert llm.llm_engine.get_stats()["spec_decode_num_draft_tokens_total"] == 0
    assert not proposer.seqs  # the draft never prefilled it
    short_prompt = long_prompt[:8]
    assert generate(llm, [short_prompt], temperature=0, max_tokens=40) == generate(
        plain, [short_prompt], temperature=0, max_tokens=40
    )
    assert llm.llm_engine.get_stats()["spec_decode_num_draft_tokens_total"] > 0
    assert_no_leak(llm)


def test_the_draft_cost_defaults_to_its_share_of_the_targets_weight_bytes(tiny_model_dir, model_factory):
    small = model_factory("llama", num_hidden_layers=1)
    llm = LLM(
        model=tiny_model_dir,
        dtype="float32",
        max_model_len=256,
        speculative_config={"method": "draft_model", "num_speculative_tokens": 2, "model": small},
    )
    target_bytes = llm.llm_engine.memory["weights_bytes"]
    proposer = llm.llm_engine.speculator.proposer
    assert 0 < proposer.cost_per_token < 1
    assert proposer.cost_per_token == weight_bytes(proposer.model) / target_bytes


def test_rejection_rule_keeps_the_target_distribution():
    """A chi-square test over 20,000 seeded draws on an 8-token vocabulary: the first emitted token
    follows the target's p whatever the proposal, and a proposal is kept with probability p(x)."""
    from scipy.stats import chisquare

    vocab = 8
    logits = torch.log(torch.tensor([0.30, 0.20, 0.15, 0.12, 0.10, 0.07, 0.04, 0.02]))
    rows = logits.repeat(3, 1)
    verify = RejectionSampler(Sampler(vocab, eos_token_ids=[]))
    counts, kept = torch.zeros(vocab), 0
    trials, draft = 20000, [1, 3]
    for seed in range(trials):
        seq = Request("r", None, [0], SamplingParams(temperature=1.0, seed=seed, max_tokens=8))
        tokens, _ = verify(rows, seq, draft)
        counts[tokens[0]] += 1
        kept += tokens[0] == draft[0]
    probs = torch.softmax(logits, dim=-1)
    assert chisquare(counts.numpy(), (probs * trials).numpy()).pvalue > 1e-3
    assert kept / trials == pytest.approx(probs[draft[0]].item(), abs=0.015)


def test_penalties_bad_words_and_min_tokens_speculate_with_plain_decodings_tokens(tiny_model_dir, plain, monkeypatch):
    """Each verification row is processed as a plain step processes its position: penalties count the
    proposals before it, bad_words and min_tokens see them (a row that shared its sequence's state would
    ban EOS past min_tokens, or miss a penalty, and part from plain decoding)."""
    speculate_every_step(monkeypatch)
    prompts = repetitive_prompts(2)
    eos = plain.llm_engine.eos_token_ids[0]
    unpenalised = generate(plain, prompts, temperature=0, max_tokens=40)
    tokenizer = plain.llm_engine.tokenizer
    bad_word = tokenizer.decode(unpenalised[1][10:12]).strip()
    cases = [
        dict(temperature=0, repetition_penalty=1.5),
        dict(temperature=0, presence_penalty=1.0, frequency_penalty=1.0),
        dict(temperature=0.8, seed=3, frequency_penalty=1.5),
        dict(temperature=0, bad_words=[bad_word]),
        dict(temperature=0, min_tokens=13, ignore_eos=False, logit_bias={eos: 20.0}),
    ]
    # the target drafting for itself proposes every step (n-gram matches are rare under a penalty); its
    # proposals are its unprocessed argmax, so the penalised rows reject some of them
    llm = LLM(model=tiny_model_dir, dtype="float32", max_model_len=512, speculative_config=draft_of(tiny_model_dir))
    for params in cases:
        expected = generate(plain, prompts, max_tokens=40, **params)
        assert expected != unpenalised  # the parameter changes what plain decoding gives
        drafts = llm.llm_engine.get_stats()["spec_decode_num_drafts_total"]
        assert generate(llm, prompts, max_tokens=40, **params) == expected, params
        assert llm.llm_engine.get_stats()["spec_decode_num_drafts_total"] > drafts  # and it speculated
    assert [len(tokens) for tokens in expected] == [14] * len(prompts)  # min_tokens, then EOS
    assert_no_leak(llm)


def test_each_verification_row_is_masked_as_the_grammar_stands_after_the_proposals_before_it(tiny_model_dir):
    tokenizer = load_tokenizer(tiny_model_dir)
    vocab = len(tokenizer)
    compiler = GrammarCompiler(tokenizer, vocab_size=vocab, stop_token_ids=[tokenizer.eos_token_id])
    grammar = compiler.compile(StructuredOutputs(regex="(ab|cd)x{1,3}"))
    a, b, c, x = (tokenizer.convert_tokens_to_ids(char) for char in "abcx")
    seq = Request("r", None, [5, 6, 7], SamplingParams(temperature=0, repetition_penalty=1.2))
    seq.matcher = compiler.matcher(grammar)
    assert grammar_prefix(seq.matcher, [a, b, x, c, x]) == [a, b, x]  # cut where the grammar refuses
    drafts = [a, b, x]
    logits = torch.randn(len(drafts) + 1, vocab, generator=torch.Generator().manual_seed(0))
    rows = [seq, *(DraftedRow(seq, drafts[:j]) for j in range(1, len(drafts) + 1))]
    processed, _ = Sampler(vocab, [tokenizer.eos_token_id]).process(logits, rows)
    for j in range(len(drafts) + 1):  # what a plain step gives the sequence with drafts[:j] appended
        alone = Request("r", None, [5, 6, 7], seq.params)
        alone.token_ids += drafts[:j]
        alone.matcher = compiler.matcher(grammar)
        assert all(alone.matcher.accept_token(token) for token in drafts[:j])
        expected, _ = Sampler(vocab, [tokenizer.eos_token_id]).process(logits[j : j + 1], [alone])
        assert torch.equal(processed[j], expected[0]), j
    assert torch.isfinite(processed[1]).nonzero().flatten().tolist() == [b]  # after "a" only "b"
    assert seq.matcher.accept_token(c)  # the sequence's own matcher never moved
    compiler.shutdown()


def test_a_proposal_the_grammar_refuses_counts_against_the_sequences_k(tiny_model_dir, monkeypatch):
    """A draft that keeps proposing what the grammar refuses pays its forwards for nothing: each cut is a
    rejection, so the sequence's acceptance falls and k with it."""
    speculate_every_step(monkeypatch)
    engine = LLM(model=tiny_model_dir, dtype="float32", max_model_len=512, speculative_config=NGRAM).llm_engine
    tokenizer = engine.tokenizer
    a, b, x = (tokenizer.convert_tokens_to_ids(char) for char in "abx")
    seq = Request("r", None, [5, 6, 7], SamplingParams(temperature=0))
    seq.num_computed_tokens = seq.num_tokens - 1  # a decode
    compiler = engine.structured.compiler
    seq.matcher = compiler.matcher(compiler.compile(StructuredOutputs(regex="ab+")))
    monkeypatch.setattr(engine.speculator.proposer, "propose", lambda seqs, ks: [[a, x, x, x]])
    assert engine.speculator.propose([seq]) == [] and seq.spec_token_ids == [a]
    once = engine.speculator.acceptance[seq].rate
    monkeypatch.setattr(engine.speculator.proposer, "propose", lambda seqs, ks: [[x, b, b, b]])
    engine.speculator.propose([seq])
    assert seq.spec_token_ids == [] and engine.speculator.acceptance[seq].rate < once < speculator.PRIOR_ACCEPTANCE


def test_structured_outputs_speculate_with_plain_decodings_tokens(tiny_model_dir, plain, monkeypatch):
    speculate_every_step(monkeypatch)
    prompts = repetitive_prompts(3)[:2]
    llm = LLM(model=tiny_model_dir, dtype="float32", max_model_len=512, speculative_config=draft_of(tiny_model_dir))
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    specs = [{"regex": "(.|\n){1,30}"}, {"json": schema}, {"choice": ["yes", "no", "maybe so"]}]
    for spec in specs:
        accepted = llm.llm_engine.get_stats()["spec_decode_num_accepted_tokens_total"]
        params = SamplingParams(temperature=0, max_tokens=40, structured_outputs=spec)
        expected = plain.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
        got = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in expected]
        assert all(o.outputs[0].finish_reason == "stop" for o in got)
        if "regex" in spec:  # a grammar its proposals stay inside: they are verified and kept
            assert llm.llm_engine.get_stats()["spec_decode_num_accepted_tokens_total"] > accepted + 10
        if "json" in spec:
            assert all(json.loads(o.outputs[0].text).keys() == {"ok"} for o in got)
    assert_no_leak(llm)


class SevensProposer:
    """Proposes 7, 7, ...; at 0.6 of a target step a token, as dear as a draft model."""

    cost_per_token = 0.6

    def propose(self, seqs, ks):
        return [[7] * k for k in ks]

    def catch_up_tokens(self, seq):
        return 0


def a_decode(request_id: str) -> Request:
    seq = Request(request_id, None, [1, 2, 3], SamplingParams(temperature=0, max_tokens=100))
    seq.num_computed_tokens = seq.num_tokens - 1
    return seq


def test_a_costly_proposer_is_tried_before_it_is_measured_and_then_follows_the_measure():
    """At a free proposer's prior (0.5) no k pays for a proposer this dear, so it would never be tried and its
    acceptance never measured. Before the engine's first verification a sequence starts at 1.0; later ones
    start from the engine's recent measure, which drifts back up while nothing is proposed."""
    config = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 4})
    spec = speculator.Speculator(config, SevensProposer(), Sampler(16, [0]), EngineMetrics(), max_model_len=256)
    spec.costs = StepCosts(SevensProposer.cost_per_token, measure_proposals=False, max_k=4)  # priced, not timed
    spec.costs.observe_step(1, 0.010)  # a plain step timed: speculation may start
    assert best_k(4, speculator.PRIOR_ACCEPTANCE, 1, spec.costs) == 0
    first = a_decode("first")
    spec.propose([first])
    assert first.spec_token_ids == [7, 7, 7, 7]  # tried
    rejecting = torch.zeros(5, 16)
    rejecting[:, 5] = 1.0  # the target wants 5 where 7 was proposed
    for _ in range(3):
        assert spec.verify(rejecting, first, [7, 7, 7, 7])[0] == [5]
    measured = spec.measured.rate
    assert measured < speculator.PRIOR_ACCEPTANCE
    later = a_decode("later")
    spec.propose([later])
    assert later.spec_token_ids == [] and spec.acceptance[later].prior == pytest.approx(measured)
    for step in range(20):  # steps with nothing proposed raise the measure until a new sequence tries again
        retried = a_decode(f"retried-{step}")
        spec.propose([retried])
        if retried.spec_token_ids:
            break
    assert retried.spec_token_ids and 0 < step < 20 and spec.measured.rate > measured
    free = speculator.Speculator(config, NgramProposer(1, 3), Sampler(16, [0]), EngineMetrics(), max_model_len=256)
    assert free.measured is None  # a free proposer's sequences start at PRIOR_ACCEPTANCE
