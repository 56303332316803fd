"""Penalties through /v1 with the official openai client against the live stack (issue 16).

Black box: only the public HTTP surface. The bare engine in-process is the reference (its own
penalty tests check it against HF's logits processors and OpenAI's formula).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from inference import LLM, SamplingParams

pytestmark = pytest.mark.slow
PROMPT_IDS = [11, 12, 13, 11, 12, 13, 11, 12]
PENALTIES = [
    {"frequency_penalty": 1.2},
    {"presence_penalty": 1.5},
    {"extra_body": {"repetition_penalty": 1.6}},
    {"frequency_penalty": -0.4, "presence_penalty": 0.8, "extra_body": {"repetition_penalty": 1.3}},
]


@pytest.fixture(scope="module")
def offline(tiny_model_dir):
    from tests.platform.live_stack import ENGINE_ARGS

    return LLM(model=tiny_model_dir, **ENGINE_ARGS)


def offline_text(offline, penalties: dict, max_tokens: int = 12) -> str:
    params = {k: v for k, v in penalties.items() if k != "extra_body"} | penalties.get("extra_body", {})
    return (
        offline.generate(
            prompt_token_ids=[PROMPT_IDS],
            use_tqdm=False,
            sampling_params=SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **params),
        )[0]
        .outputs[0]
        .text
    )


def complete(client, live_stack, penalties: dict, max_tokens: int = 12):
    extra = {"ignore_eos": True} | penalties.get("extra_body", {})
    kwargs = {k: v for k, v in penalties.items() if k != "extra_body"}
    return client.completions.create(
        model=live_stack.model_name, prompt=PROMPT_IDS, max_tokens=max_tokens, temperature=0, extra_body=extra, **kwargs
    )


@pytest.mark.parametrize("penalties", PENALTIES, ids=["frequency", "presence", "repetition", "combined"])
def test_each_penalty_is_served_and_equals_the_bare_engine(client, live_stack, offline, penalties):
    reply = complete(client, live_stack, penalties)
    assert reply.choices[0].finish_reason == "length"
    assert reply.choices[0].text == offline_text(offline, penalties)
    assert reply.choices[0].text != offline_text(offline, {})  # the penalty took effect


def test_a_penalized_request_among_plain_streams_fails_nobody(client, live_stack, offline):
    """The issue's scene: 8 ordinary streams in flight plus one with a penalty; all nine must finish."""

    def plain_stream():
        chunks = client.completions.create(
            model=live_stack.model_name,
            prompt=PROMPT_IDS,
            max_tokens=24,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        return "".join(c.choices[0].text for c in chunks if c.choices)

    with ThreadPoolExecutor(9) as pool:
        streams = [pool.submit(plain_stream) for _ in range(8)]
        penalized = pool.submit(complete, client, live_stack, {"frequency_penalty": 0.5}, 24)
        texts = [s.result(timeout=120) for s in streams]
        reply = penalized.result(timeout=120)
    assert texts == [offline_text(offline, {}, 24)] * 8
    assert reply.choices[0].text == offline_text(offline, {"frequency_penalty": 0.5}, 24)
