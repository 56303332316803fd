"""SamplingParams: defaults as in vLLM, and every invalid value raises ValueError naming its field."""

import pytest

from inference.sampling_params import SamplingParams


def test_defaults_match_vllm():
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p) == (1, 1.0, 1.0, -1, 0.0)
    assert (p.max_tokens, p.min_tokens, p.seed, p.logprobs, p.prompt_logprobs) == (16, 0, None, None, None)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.0, 0.0, 1.0)
    assert p.stop_strings == [] and p.stop_token_ids == []
    assert p.skip_special_tokens and not p.ignore_eos and not p.include_stop_str_in_output
    assert not p.greedy and not p.uses_penalties


def test_normalisation():
    assert SamplingParams(top_k=0).top_k == -1  # 0 and -1 both mean off
    assert SamplingParams(stop="###").stop_strings == ["###"]
    assert SamplingParams(stop=["a", "b"]).stop_strings == ["a", "b"]
    assert SamplingParams(stop_token_ids=(3, 4)).stop_token_ids == [3, 4]
    assert SamplingParams(temperature=0).greedy
    assert SamplingParams(repetition_penalty=1.1).uses_penalties
    assert SamplingParams(max_tokens=None).max_tokens is None


@pytest.mark.parametrize(
    "field, value",
    [
        ("n", 0),
        ("n", -1),
        ("n", 1.5),
        ("n", "2"),
        ("temperature", -0.1),
        ("temperature", float("nan")),
        ("temperature", "hot"),
        ("top_p", 0.0),
        ("top_p", 1.01),
        ("top_p", -0.5),
        ("top_k", -2),
        ("top_k", 1.5),
        ("top_k", "5"),
        ("min_p", -0.1),
        ("min_p", 1.5),
        ("min_p", "a"),
        ("max_tokens", 0),
        ("max_tokens", -3),
        ("max_tokens", 2.5),
        ("max_tokens", "10"),
        ("min_tokens", -1),
        ("min_tokens", 1.5),
        ("presence_penalty", 2.5),
        ("presence_penalty", -2.5),
        ("presence_penalty", None),
        ("frequency_penalty", 2.01),
        ("frequency_penalty", -3),
        ("frequency_penalty", "x"),
        ("repetition_penalty", 0.0),
        ("repetition_penalty", -1.0),
        ("logprobs", -1),
        ("logprobs", 21),
        ("logprobs", 1.5),
        ("prompt_logprobs", -1),
        ("prompt_logprobs", 21),
        ("prompt_logprobs", "3"),
        ("stop", ""),
        ("stop", ["ok", ""]),
        ("stop", ["ok", 3]),
        ("stop", 5),
        ("stop_token_ids", [-1]),
        ("stop_token_ids", ["2"]),
        ("stop_token_ids", 7),
        ("seed", "42"),
        ("seed", 1.5),
    ],
)
def test_invalid_value_raises_value_error_naming_the_field(field, value):
    with pytest.raises(ValueError, match=rf"\b{field}\b"):
        SamplingParams(**{field: value})


def test_unset_fields_take_the_model_defaults_and_set_ones_stay():
    unset = SamplingParams(top_p=None)  # None is the same as leaving it out
    assert unset.model_default_fields == {"temperature", "top_p", "top_k", "min_p", "repetition_penalty"}
    model = {"temperature": 0.2, "top_p": 0.9, "top_k": 0, "repetition_penalty": 1.1}
    resolved = unset.with_model_defaults(model)
    assert (resolved.temperature, resolved.top_p, resolved.top_k, resolved.min_p, resolved.repetition_penalty) == (
        0.2,
        0.9,
        -1,
        0.0,
        1.1,
    )
    assert unset.temperature == 1.0  # the original keeps vLLM's fallbacks
    explicit = SamplingParams(temperature=1.0, repetition_penalty=1.0).with_model_defaults(model)
    assert (explicit.temperature, explicit.repetition_penalty, explicit.top_p) == (1.0, 1.0, 0.9)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams().with_model_defaults({"top_p": 1.5})  # a broken model default names its field


def test_min_tokens_above_max_tokens_names_min_tokens():
    with pytest.raises(ValueError, match="min_tokens") as info:
        SamplingParams(min_tokens=10, max_tokens=5)
    assert "max_tokens" in str(info.value)
    assert SamplingParams(min_tokens=5, max_tokens=5).min_tokens == 5
    assert SamplingParams(min_tokens=50, max_tokens=None).min_tokens == 50


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(temperature=0.0),
        dict(temperature=2.0),
        dict(top_p=1.0),
        dict(top_p=0.01),
        dict(top_k=1),
        dict(min_p=1.0),
        dict(max_tokens=1),
        dict(presence_penalty=-2),
        dict(frequency_penalty=2),
        dict(repetition_penalty=0.5),
        dict(logprobs=0),
        dict(logprobs=20),
        dict(prompt_logprobs=0),
        dict(stop=["a", "bc"]),
        dict(stop_token_ids=[0, 5]),
        dict(seed=0),
        dict(n=4, seed=7),
    ],
)
def test_boundary_values_are_accepted(kwargs):
    """A value at a limit is valid, and kept as given: neither clamped nor normalised away."""
    params = SamplingParams(**kwargs)
    assert {name: getattr(params, name) for name in kwargs} == kwargs


def test_for_child_gives_n_one_and_consecutive_seeds():
    parent = SamplingParams(n=3, seed=10, temperature=0.7, stop=["x"])
    children = [parent.for_child(i) for i in range(3)]
    assert [c.seed for c in children] == [10, 11, 12]
    assert all(c.n == 1 and c.temperature == 0.7 and c.stop_strings == ["x"] for c in children)
    assert SamplingParams(n=2).for_child(1).seed is None
