"""The fair policy in the real engine: greedy outputs stay HF-exact while tenants reorder, interleave
and preempt each other; bad tenant input is a ValueError at add_request, never a crash in a step."""

from __future__ import annotations

import pytest
from test_correctness import assert_no_leak, greedy, prompts_of_lengths
from tiny_models import hf_greedy

from inference import LLM


def run_tenants(llm, prompts, tenants, weights, max_tokens):
    engine = llm.llm_engine
    for i, (prompt, tenant, weight) in enumerate(zip(prompts, tenants, weights)):
        engine.add_request(str(i), {"prompt_token_ids": prompt}, greedy(max_tokens), tenant=tenant, weight=weight)
    finished = {}
    while engine.has_unfinished_requests():
        for out in engine.step(final_only=True):
            finished[out.request_id] = out.outputs[0].token_ids
    return [finished[str(i)] for i in range(len(prompts))]


@pytest.mark.parametrize("policy", ["fair", "fcfs"])
def test_greedy_outputs_match_hf_under_the_policy_with_preemption(model_factory, policy):
    model_dir = model_factory("llama")
    prompts = prompts_of_lengths([40, 90, 25, 120, 60, 33, 7, 64], seed=4)
    tenants = ["a", "a", "a", "a", "b", None, "c", "b"]
    weights = [1.0, 1.0, 1.0, 1.0, 3.0, 1.0, 0.5, 3.0]
    # 24 blocks of 16 = 384 slots and a 32-token budget: waiting, chunked prefill and preemption
    llm = LLM(
        model=model_dir,
        dtype="float32",
        max_model_len=256,
        num_kv_blocks=24,
        block_size=16,
        max_num_batched_tokens=32,
        scheduling_policy=policy,
    )
    ours = run_tenants(llm, prompts, tenants, weights, 30)
    assert llm.llm_engine.scheduler.num_preemptions > 0
    assert ours == hf_greedy(model_dir, prompts, 30)
    assert_no_leak(llm)
    stats = llm.llm_engine.get_stats()
    assert stats["scheduling_policy"] == policy
    served = {row["tenant"]: row["tokens"] for row in stats["tenant_shares"]["tenants"]}
    # every prompt token once (a recompute is not charged again) and every output token twice
    assert served == {"a": 275 + 4 * 60, "b": 124 + 2 * 60, "c": 7 + 60}
    assert stats["tenant_shares"]["others"]["tokens"] == 33 + 60


@pytest.mark.parametrize("weight", [0, -2.5, float("nan"), "2"])
def test_a_bad_weight_is_a_value_error_before_anything_is_queued(tiny_llm, weight):
    engine = tiny_llm.llm_engine
    with pytest.raises(ValueError, match="weight must be a positive number"):
        engine.add_request("bad", {"prompt_token_ids": [1, 2, 3]}, greedy(2), tenant="a", weight=weight)
    assert not engine.has_unfinished_requests()


def test_an_unknown_policy_is_refused_at_start(tiny_model_dir):
    with pytest.raises(ValueError, match="scheduling_policy must be one of fcfs, priority, fair"):
        LLM(model=tiny_model_dir, dtype="float32", max_model_len=64, scheduling_policy="lottery")
