"""Every public SamplingParams field, in combinations the API accepts, goes through real engine steps.

A parameter that makes the step raise can't ship again (issue 16: any penalty failed the whole
step). Hypothesis draws batches of one to three requests with values across each field's
accepted range (/v1's serializer and SamplingParams' validation); every batch runs a prefill
step (with the n > 1 fork) and a decode step on one shared tiny engine, then is aborted.
"""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from inference import LLM, SamplingParams
from inference.structured_output import StructuredOutputs

PROMPT = [5, 6, 7, 8, 5, 6]

floats = lambda lo, hi: st.floats(lo, hi, allow_nan=False, allow_subnormal=False)  # noqa: E731 (torch sets flush-to-zero)
optional = lambda strategy: st.none() | strategy  # noqa: E731
maybe_default = lambda default, strategy: st.just(default) | strategy  # noqa: E731

GRAMMARS = [  # few: the engine fixture compiles each once, so every request with one runs at once
    {"json": {"type": "object", "properties": {"a": {"type": "boolean"}}, "required": ["a"]}},
    {"json_object": True},
    {"regex": "[a-c]{1,3}"},
    {"choice": ["yes", "no"]},
    {"grammar": 'root ::= "x" | "y"'},
]
stop_text = st.text(alphabet="abcdefghij .,\n", min_size=1, max_size=4)
FIELDS = {
    "n": st.integers(1, 4),
    "temperature": maybe_default(1.0, st.sampled_from([0.0, 1e-4, 2.0]) | floats(0.0, 2.0)),
    "top_p": maybe_default(1.0, st.sampled_from([1e-3, 1.0]) | floats(1e-3, 1.0)),
    "top_k": maybe_default(-1, st.sampled_from([0, 1, 10_000]) | st.integers(1, 600)),
    "min_p": maybe_default(0.0, st.sampled_from([1.0]) | floats(0.0, 1.0)),
    "seed": optional(st.sampled_from([0, -1, -(2**63), 2**64 - 1]) | st.integers(-(2**31), 2**31)),
    "max_tokens": optional(st.integers(1, 4)),
    "min_tokens": st.integers(0, 4),
    "stop": optional(stop_text | st.lists(stop_text, max_size=3)),
    "stop_token_ids": optional(st.lists(st.integers(0, 100_000), max_size=3)),
    "ignore_eos": st.booleans(),
    "presence_penalty": maybe_default(0.0, st.sampled_from([-2.0, 2.0]) | floats(-2.0, 2.0)),
    "frequency_penalty": maybe_default(0.0, st.sampled_from([-2.0, 2.0]) | floats(-2.0, 2.0)),
    "repetition_penalty": maybe_default(1.0, st.sampled_from([0.01, 100.0]) | floats(0.01, 10.0)),
    "logprobs": optional(st.integers(0, 20)),
    "prompt_logprobs": optional(st.integers(0, 20)),
    "skip_special_tokens": st.booleans(),
    "include_stop_str_in_output": st.booleans(),
    "structured_outputs": optional(st.sampled_from(GRAMMARS)),
    "logit_bias": optional(st.dictionaries(st.integers(0, 300), floats(-100.0, 100.0), max_size=3)),
    "allowed_token_ids": optional(st.lists(st.integers(10, 300), min_size=1, max_size=5)),  # 0..9: special tokens
    "bad_words": optional(st.lists(st.text(alphabet="abcdefghij", min_size=1, max_size=4), max_size=2)),
    "speculative": st.booleans(),
}


def test_the_sweep_covers_every_public_field():
    public = {f.name for f in dataclasses.fields(SamplingParams) if f.init and f.repr}  # repr=False: set by the engine
    assert set(FIELDS) == public


@pytest.mark.parametrize("seed", [2**64, -(2**63) - 1])
def test_a_seed_torch_cannot_take_is_refused_by_name(seed):
    with pytest.raises(ValueError, match="SamplingParams.seed must be an integer in"):
        SamplingParams(seed=seed)
    SamplingParams(seed=2**64 - 1)  # the edges torch accepts
    SamplingParams(seed=-(2**63))


@st.composite
def sampling_params(draw) -> SamplingParams:
    values = {name: draw(strategy) for name, strategy in FIELDS.items()}
    if values["max_tokens"] is not None:
        values["min_tokens"] = min(values["min_tokens"], values["max_tokens"])
    if values["structured_outputs"] is not None:
        values["allowed_token_ids"] = None  # refused together (SamplingParams says why)
    if values["allowed_token_ids"] and set(values["allowed_token_ids"]) <= set(values["stop_token_ids"] or []):
        values["allowed_token_ids"] = None  # all of them stop tokens under min_tokens: nothing may be sampled
    return SamplingParams(**values)


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    engine = LLM(model=tiny_model_dir, dtype="float32", device="cpu", max_model_len=64, seed=0).llm_engine
    for spec in GRAMMARS:
        engine.structured.compiler.compile(StructuredOutputs(**spec))
    return engine


@settings(
    max_examples=120, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(batch=st.lists(sampling_params(), min_size=1, max_size=3))
def test_any_accepted_parameters_survive_engine_steps(engine, batch):
    ids = [f"sweep-{i}" for i in range(len(batch))]
    for rid, params in zip(ids, batch):
        engine.add_request(rid, {"prompt_token_ids": PROMPT}, params)
    outputs = {}
    try:
        for _ in range(2):  # the prefill (and fork) step, then one decode step
            outputs.update((out.request_id, out) for out in engine.step())
    finally:
        engine.abort_request(ids)
    vocab = engine.model_config.vocab_size
    for rid, params in zip(ids, batch):
        out = outputs[rid]
        assert out.error is None, out.error
        assert len(out.outputs) in (1, params.n)
        for completion in out.outputs:
            assert 1 <= len(completion.token_ids) <= 2
            assert all(0 <= t < vocab for t in completion.token_ids)
            if params.logprobs is not None:
                assert len(completion.logprobs) == len(completion.token_ids)
        if params.prompt_logprobs is not None:
            assert len(out.prompt_logprobs) == len(PROMPT)
    assert engine.get_stats()["blocks_used"] == 0 and not engine.has_unfinished_requests()


def run_alone(engine, rid: str, params: SamplingParams):
    engine.add_request(rid, {"prompt_token_ids": PROMPT}, params)
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                return out


def test_the_last_fork_of_the_largest_seed_wraps_like_torch(engine):
    """Sequence i of n samples with seed + i; past 2**64 - 1 that wraps to what torch would do."""
    common = dict(temperature=1.0, max_tokens=4, ignore_eos=True)
    forked = run_alone(engine, "wrap-n2", SamplingParams(n=2, seed=2**64 - 1, **common))
    assert forked.error is None
    assert (
        forked.outputs[0].token_ids
        == run_alone(engine, "wrap-a", SamplingParams(seed=-1, **common)).outputs[0].token_ids
    )
    assert (
        forked.outputs[1].token_ids
        == run_alone(engine, "wrap-b", SamplingParams(seed=0, **common)).outputs[0].token_ids
    )
