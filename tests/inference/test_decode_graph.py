"""Captured decode steps (inference/decode_graph.py): replayed kernel calls give what the model gives.

Tiny random models written as GGUF files (test_gguf.write_gguf) and run packed, so every linear is a C
kernel call and decode steps can be captured; each engine is compared with the same file under
enforce_eager, token for token. A file with one dense matrix cannot be captured and runs eagerly.
"""

from __future__ import annotations

import pytest
from test_gguf import ENGINE, PROMPTS, private_cache, write_gguf  # noqa: F401 (private_cache: autouse)
from test_gguf_packed import PACKED
from tiny_models import make_tiny_model

from inference import LLM, SamplingParams, decode_graph

QWEN_MIX = ("Q8_0", "Q5_0", "Q4_K", "Q6_K")  # the 0.5B Qwen file's types


@pytest.fixture(scope="module")
def qwen_file(tmp_path_factory):
    root = tmp_path_factory.mktemp("decode-graph")
    hf_dir = make_tiny_model(root / "hf", "qwen2", hidden_size=256, intermediate_size=256)
    return str(write_gguf(hf_dir, root / "tiny-qwen2.gguf", QWEN_MIX))


def tokens(llm, prompts, params):
    outputs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs]


def graphs_of(llm):
    return llm.llm_engine.runner.decode_graphs


# 40 tokens: sequences cross block boundaries (16 tokens a block) while their steps are replayed
GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)


def test_replayed_decodes_give_the_eager_tokens_alone_and_batched(qwen_file):
    captured, eager = LLM(model=qwen_file, **PACKED), LLM(model=qwen_file, enforce_eager=True, **PACKED)
    assert graphs_of(eager) is None
    for prompts in ([PROMPTS[0]], [PROMPTS[1]], PROMPTS):
        assert tokens(captured, prompts, GREEDY) == tokens(eager, prompts, GREEDY)
    graphs = graphs_of(captured)
    assert {1, 3} <= set(graphs.graphs) and not graphs.refused
    assert graphs.replays >= 2 * 38 - 1 + 30  # every decode step after each batch size's first


def test_seeded_sampling_is_unchanged(qwen_file):
    params = SamplingParams(temperature=0.9, top_p=0.9, max_tokens=24, seed=7, ignore_eos=True)
    captured, eager = LLM(model=qwen_file, **PACKED), LLM(model=qwen_file, enforce_eager=True, **PACKED)
    assert tokens(captured, PROMPTS, params) == tokens(eager, PROMPTS, params)
    assert graphs_of(captured).replays > 0


def test_a_wider_block_table_is_captured_again(qwen_file, monkeypatch):
    monkeypatch.setattr(decode_graph, "MIN_TABLE_WIDTH", 1)  # widths 1, 2, 4: a capture at each
    captured, eager = LLM(model=qwen_file, **PACKED), LLM(model=qwen_file, enforce_eager=True, **PACKED)
    assert tokens(captured, [PROMPTS[2]], GREEDY) == tokens(eager, [PROMPTS[2]], GREEDY)
    assert graphs_of(captured).graphs[1].width == 4  # 8 + 40 tokens need 3 blocks of 16


def test_the_engine_captures_batch_one_while_it_warms_up(qwen_file):
    llm = LLM(model=qwen_file, **PACKED)
    llm.llm_engine.warm_up()
    assert 1 in graphs_of(llm).graphs


def test_a_dense_matrix_keeps_its_batch_size_eager(tmp_path):
    hf_dir = make_tiny_model(tmp_path / "hf", "llama", hidden_size=256, intermediate_size=256)
    file = str(write_gguf(hf_dir, tmp_path / "tiny-mixed.gguf", ("Q8_0", "F16", "Q4_K")))
    captured, eager = LLM(model=file, **PACKED), LLM(model=file, enforce_eager=True, **PACKED)
    assert tokens(captured, [PROMPTS[0]], GREEDY) == tokens(eager, [PROMPTS[0]], GREEDY)
    graphs = graphs_of(captured)
    assert graphs.graphs == {} and graphs.replays == 0
    assert any("linear" in op or "mm" in op for op in graphs.refused[1])


def test_a_float32_model_is_never_replayed(tmp_path):
    hf_dir = make_tiny_model(tmp_path / "hf", "llama")
    llm = LLM(model=str(hf_dir), **ENGINE)
    tokens(llm, [PROMPTS[0]], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    graphs = graphs_of(llm)
    assert graphs.replays == 0 and 1 in graphs.refused


def test_speculation_never_times_a_step_that_was_captured(qwen_file):
    # a shape's first decode step runs eagerly while it is captured, several times slower than the replays
    # after it: timed, it would price that step size (1 + k tokens) out of speculation
    ngram = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 2}
    llm = LLM(model=qwen_file, speculative_config=ngram, **PACKED)
    engine = llm.llm_engine
    captured, timed_after_capture = [], []
    execute, observe = engine.runner.execute, engine.speculator.costs.observe_step

    def spy_execute(inputs):
        result = execute(inputs)
        captured.append(engine.runner.last_step_captured)
        return result

    def spy_observe(num_tokens, seconds):
        timed_after_capture.append(captured[-1])
        observe(num_tokens, seconds)

    engine.runner.execute, engine.speculator.costs.observe_step = spy_execute, spy_observe
    tokens(llm, PROMPTS, GREEDY)
    assert any(captured) and timed_after_capture and not any(timed_after_capture)
