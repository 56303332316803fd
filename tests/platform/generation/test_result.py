"""generation.result.Result: the one accumulator every front door folds engine events into."""

from generation.result import Result
from generation.services import Generation


def test_a_result_keeps_every_choice_and_the_finish_event_closes_the_open_ones():
    result = Result(n=3)
    for event in [
        {"type": "delta", "index": 1, "text": "b", "token_ids": [2], "finish_reason": None},
        {"type": "delta", "index": 0, "text": "a", "token_ids": [1], "finish_reason": "stop", "stop_reason": "x"},
        {"type": "finish", "finish_reasons": ["stop", "abort"], "usage": {"prompt_tokens": 3}, "metrics": {}},
    ]:
        result.add(event)
    assert [c.index for c in result.choices] == [0, 1, 2]
    assert [c.finish_reason for c in result.choices] == ["stop", "abort", None]
    assert result.choices[0].stop_reason == "x" and result.usage == {"prompt_tokens": 3}
    assert result.ended and result.was_aborted and result.tokens_seen == 2


def test_times_come_from_the_workers_stream_entry_ids_so_every_front_door_measures_alike():
    gen = Generation(
        source="batch",
        endpoint="/v1/completions",
        user=None,
        model="m",
        prompts=[[1, 2]],
        sampling_params={},
        arrived_at=1000.0,
    )
    gen.result.add({"type": "delta", "index": 0, "text": "", "token_ids": [], "entry_id": "1000100-0"})
    gen.result.add({"type": "delta", "index": 0, "text": "x", "token_ids": [5], "entry_id": "1000250-0"})
    gen.result.add({"type": "delta", "index": 0, "text": "y", "token_ids": [6], "entry_id": "1000300-1"})
    gen.result.add(
        {
            "type": "finish",
            "finish_reasons": ["length"],
            "metrics": {"ttft_ms": 40.0},
            "usage": {"prompt_tokens": 2, "completion_tokens": 2, "cached_tokens": 0},
            "entry_id": "1000400-0",
        }
    )
    assert gen.ttft_ms == 250.0  # the first delta that carries a token, not the first event
    assert gen.engine_ttft_ms == 40.0 and gen.latency_ms == 400.0
    assert gen.outcome == (200, "") and gen.charged_tokens() == (2, 2)


def test_an_engine_error_is_the_outcome_and_what_was_seen_is_charged():
    gen = Generation(
        source="api", endpoint="/v1/completions", user=None, model="m", prompts=[[1, 2, 3]], sampling_params={}
    )
    gen.result.add({"type": "delta", "index": 0, "text": "x", "token_ids": [5]})
    gen.result.add({"type": "error", "code": "worker_lost", "message": "gone"})
    assert gen.outcome == (503, "worker_lost")
    assert gen.charged_tokens() == (3, 1)
    gen.fail(499, "client_disconnected")  # what the front door saw wins over what the engine said
    assert gen.outcome == (499, "client_disconnected")


def test_several_prompts_are_one_generation_with_one_engine_request_each():
    gen = Generation(
        source="api",
        endpoint="/v1/completions",
        user=None,
        model="m",
        prompts=[[1], [2, 3]],
        sampling_params={},
        n=2,
        request_id="cmpl-x",
    )
    assert gen.engine_request_ids == ["cmpl-x-0", "cmpl-x-1"]
    assert (gen.prompt_tokens, gen.longest_prompt_tokens, gen.num_choices, gen.result.n) == (3, 2, 4, 4)
