"""Structured outputs through the engine: valid under sampling, n > 1 forks, continuous batching,
preemption and prefix-cache hits, and a grammar that cannot compile fails its request alone.

A tiny random model wants to go anywhere, which is what makes it a good test of the masks; the
grammars are bounded so that every walk through them ends well inside max_tokens.
"""

import json
import re

import pytest

from inference import LLM, SamplingParams

SCHEMA = {
    "type": "object",
    "additionalProperties": False,
    "required": ["colour", "size", "ok"],
    "properties": {
        "colour": {"enum": ["red", "green", "blue"]},
        "size": {"type": "string", "pattern": "^[a-z]{1,6}$"},
        "ok": {"type": "boolean"},
    },
}
PROMPTS = [[(5 * i + j) % 400 + 10 for j in range(12 + 9 * i)] for i in range(6)]


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    return LLM(model=tiny_model_dir, dtype="float32", max_model_len=256)


def valid(text: str) -> bool:
    value = json.loads(text)
    return (
        set(value) == {"colour", "size", "ok"}
        and value["colour"] in ("red", "green", "blue")
        and re.fullmatch("[a-z]{1,6}", value["size"]) is not None
        and isinstance(value["ok"], bool)
    )


def constrained(**kwargs) -> SamplingParams:
    return SamplingParams(max_tokens=80, structured_outputs={"json": SCHEMA}, **kwargs)


def generate(llm, prompts, params):
    return llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)


def test_sampled_outputs_and_n_forks_are_all_valid_and_stop_at_the_grammars_end(llm):
    outs = generate(llm, PROMPTS, [constrained(temperature=1.0, seed=s, n=3) for s in range(len(PROMPTS))])
    choices = [c for out in outs for c in out.outputs]
    assert len(choices) == 3 * len(PROMPTS)
    for choice in choices:
        assert valid(choice.text), choice.text
        assert choice.finish_reason == "stop"
    assert len({c.text for c in choices}) > 3  # sampling still samples inside the grammar


def test_unconstrained_neighbours_keep_their_tokens(llm):
    plain = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    alone = generate(llm, PROMPTS[:3], plain)
    mixed = generate(llm, PROMPTS[:3] + PROMPTS[3:], [plain] * 3 + [constrained(temperature=0)] * 3)
    assert [o.outputs[0].token_ids for o in mixed[:3]] == [o.outputs[0].token_ids for o in alone]
    assert all(valid(o.outputs[0].text) for o in mixed[3:])


def test_preemption_and_prefix_cache_hits_keep_greedy_constrained_tokens(tiny_model_dir, llm):
    reference = [o.outputs[0].token_ids for o in generate(llm, PROMPTS, constrained(temperature=0))]
    small = LLM(model=tiny_model_dir, dtype="float32", max_model_len=256, num_kv_blocks=16, block_size=16)
    squeezed = generate(small, PROMPTS, constrained(temperature=0))
    assert small.llm_engine.scheduler.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in squeezed] == reference
    again = generate(small, PROMPTS[-1:], constrained(temperature=0))[0]  # its prompt blocks are cached
    assert again.num_cached_tokens > 0 and again.outputs[0].token_ids == reference[-1]


@pytest.mark.parametrize(
    "spec, accepts",
    [
        ({"choice": ["yes", "no", "not sure"]}, lambda t: t in ("yes", "no", "not sure")),
        ({"regex": r"[0-9]{3}-[a-z]{2}"}, lambda t: re.fullmatch(r"[0-9]{3}-[a-z]{2}", t)),
        ({"grammar": 'root ::= "(" [a-c] ("," [a-c]){0,3} ")"'}, lambda t: re.fullmatch(r"\([a-c](,[a-c]){0,3}\)", t)),
    ],
)
def test_choice_regex_and_grammar(llm, spec, accepts):
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=40, structured_outputs=spec) for s in range(4)]
    for out in generate(llm, PROMPTS[:4], params):
        assert accepts(out.outputs[0].text), out.outputs[0].text


def test_a_grammar_that_cannot_compile_fails_its_request_alone(llm):
    bad = SamplingParams(max_tokens=8, structured_outputs={"regex": "(unclosed"})
    good = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    failed, ok = generate(llm, PROMPTS[:2], [bad, good])
    assert failed.finished and failed.outputs[0].finish_reason == "error"
    assert "structured_outputs.regex could not be compiled" in failed.error
    assert ok.error is None and len(ok.outputs[0].token_ids) == 8
    assert not llm.llm_engine.has_unfinished_requests()


def test_an_abort_while_compiling_leaves_nothing_behind(llm):
    engine = llm.llm_engine
    engine.add_request(
        "compiling",
        {"prompt_token_ids": PROMPTS[0]},
        SamplingParams(structured_outputs={"regex": "[a-z]{1,5}(-[a-z]{1,5}){0,7}"}),
    )
    engine.abort_request("compiling")
    assert not engine.has_unfinished_requests() and "compiling" not in engine.requests


@pytest.mark.parametrize(
    "value, problem",
    [
        ({"regex": "a", "bogus": 1}, "takes only"),
        ({}, "exactly one"),
        ("json", "must be an object"),
        ({"choice": "yes"}, "choice must be a non-empty list"),
    ],
)
def test_bad_structured_outputs_name_the_field(value, problem):
    with pytest.raises(ValueError, match=f"SamplingParams.structured_outputs.*{problem}"):
        SamplingParams(structured_outputs=value)
