"""The engine's outputs as protocol events (inference/output_processor.py), without Redis: a real
tiny engine's RequestOutputs, and hand-made ones (the engine's own dataclasses) for the edge cases."""

from __future__ import annotations

from inference import SamplingParams, protocol
from inference.output_processor import OutputProcessor, RequestState
from inference.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput

PROMPT = [5, 17, 42, 99, 7, 3]


def run_through(llm, params: SamplingParams, processor: OutputProcessor, request_id: str = "op") -> list[list[dict]]:
    """Step the engine until the request ends; each step's events, as the worker would send them."""
    engine = llm.llm_engine
    engine.add_request(request_id, {"prompt_token_ids": PROMPT}, params)
    state = RequestState(
        request_id,
        "0-1",
        n=params.n,
        want_logprobs=params.logprobs,
        want_prompt_logprobs=params.prompt_logprobs,
        prompt_tokens=len(PROMPT),
    )
    steps = []
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.request_id == request_id:
                steps.append(processor.events(state, output))
    return steps


def running(index: int, token_ids: list[int], text: str, finish_reason: str | None = None) -> CompletionOutput:
    return CompletionOutput(index=index, text=text, token_ids=token_ids, finish_reason=finish_reason)


def output(completions: list[CompletionOutput], finished: bool = False, **fields) -> RequestOutput:
    return RequestOutput(
        request_id="r", prompt=None, prompt_token_ids=PROMPT, outputs=completions, finished=finished, **fields
    )


def test_the_deltas_of_a_real_engine_add_up_to_its_offline_greedy_output(tiny_llm):
    params = SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True)
    expected = tiny_llm.generate(prompt_token_ids=[PROMPT], sampling_params=params, use_tqdm=False)[0].outputs[0]
    steps = run_through(tiny_llm, params, OutputProcessor(tiny_llm.llm_engine.tokenizer))
    events = [e for step in steps for e in step]
    deltas = [e for e in events if e["type"] == "delta"]
    assert all(len(d["token_ids"]) == 1 for d in deltas), "one token per delta at stream_interval 1"
    assert [t for d in deltas for t in d["token_ids"]] == expected.token_ids
    assert "".join(d["text"] for d in deltas) == expected.text
    assert deltas[-1]["finish_reason"] == "length" and all(d["finish_reason"] is None for d in deltas[:-1])
    finish = events[-1]
    assert [e["type"] for e in events].count("finish") == 1 and finish["type"] == "finish"
    assert finish["finish_reasons"] == ["length"]
    assert finish["usage"] == {"prompt_tokens": len(PROMPT), "completion_tokens": 9, "cached_tokens": 0}
    assert finish["metrics"]["ttft_ms"] is not None and finish["metrics"]["queue_ms"] is None


def test_logprobs_name_the_chosen_token_and_at_most_the_asked_candidates(tiny_llm):
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=2, prompt_logprobs=1)
    steps = run_through(tiny_llm, params, OutputProcessor(tiny_llm.llm_engine.tokenizer), request_id="op-lp")
    events = [e for step in steps for e in step]
    prompt_events = [e for e in events if e["type"] == "prompt_logprobs"]
    assert len(prompt_events) == 1 and events[0] is prompt_events[0], "once, ahead of the first delta"
    prompt_entries = prompt_events[0]["logprobs"]
    assert [e["token_id"] for e in prompt_entries] == PROMPT
    assert prompt_entries[0]["logprob"] is None and prompt_entries[0]["top"] == []
    assert all(e["logprob"] <= 0 and len(e["top"]) <= 1 for e in prompt_entries[1:])
    for delta in (e for e in events if e["type"] == "delta"):
        [entry] = delta["logprobs"]
        assert entry["token_id"] == delta["token_ids"][0] and entry["logprob"] <= 0
        assert 1 <= len(entry["top"]) <= 2
        assert entry["top"][0]["logprob"] >= entry["top"][-1]["logprob"], "ranked best first"


def test_stream_interval_holds_tokens_but_never_the_first_or_the_last():
    processor = OutputProcessor(tokenizer=None, stream_interval=3)
    state = RequestState("r", "0-1", n=1)
    ids, text = [], ""
    sizes = []
    for token in range(1, 8):
        ids, text = ids + [token], text + "x"
        last = token == 7
        events = processor.events(state, output([running(0, ids, text, "length" if last else None)], finished=last))
        sizes += [len(e["token_ids"]) for e in events if e["type"] == "delta"]
    assert sizes == [1, 3, 3]
    assert state.completion_tokens == 7 and state.finish_reasons == ["length"]


def test_a_finished_choice_sends_nothing_more_while_its_sibling_runs():
    processor = OutputProcessor(tokenizer=None)
    state = RequestState("r", "0-1", n=2)
    first = processor.events(state, output([running(0, [4], "a", "stop"), running(1, [6], "b")]))
    assert [(e["index"], e["finish_reason"]) for e in first] == [(0, "stop"), (1, None)]
    second = processor.events(state, output([running(0, [4], "a", "stop"), running(1, [6, 8], "bc")]))
    assert [(e["index"], e["token_ids"], e["text"]) for e in second] == [(1, [8], "c")]


def test_an_engine_error_is_the_one_terminal_event():
    processor = OutputProcessor(tokenizer=None)
    state = RequestState("r", "0-1", n=1)
    events = processor.events(state, output([running(0, [4], "a")], finished=True, error="sampling: boom"))
    assert events == [{"type": "error", "code": "engine_error", "message": "sampling: boom"}]


def test_usage_counts_cached_tokens_and_preemptions_reach_the_metrics():
    processor = OutputProcessor(tokenizer=None)
    state = RequestState("r", "0-1", n=1, submitted_at=None)
    metrics = RequestMetrics(arrival_time=0.0, num_preemptions=2)
    events = processor.events(
        state, output([running(0, [4, 5], "ab", "length")], finished=True, num_cached_tokens=16, metrics=metrics)
    )
    finish = events[-1]
    assert finish["usage"] == {"prompt_tokens": len(PROMPT), "completion_tokens": 2, "cached_tokens": 16}
    assert finish["metrics"]["num_preemptions"] == 2


def test_a_candidate_without_decoded_text_is_named_by_the_tokenizer(tiny_llm):
    tokenizer = tiny_llm.llm_engine.tokenizer
    processor = OutputProcessor(tokenizer)
    state = RequestState("r", "0-1", n=1, want_logprobs=1)
    candidates = {42: Logprob(logprob=-0.5, rank=1, decoded_token="given"), 7: Logprob(logprob=-1.5, rank=2)}
    completion = CompletionOutput(index=0, text="t", token_ids=[7], logprobs=[candidates])
    [delta] = processor.events(state, output([completion]))
    [entry] = delta["logprobs"]
    assert entry == {
        "token_id": 7,
        "token": tokenizer.decode([7]),
        "logprob": -1.5,
        "top": [{"token_id": 42, "token": "given", "logprob": -0.5}],
    }


def test_the_abort_event_ends_only_the_unfinished_choices_with_abort():
    processor = OutputProcessor(tokenizer=None)
    state = RequestState("r", "0-1", n=2)
    processor.events(state, output([running(0, [4], "a", "stop"), running(1, [6], "b")]))
    event = processor.abort_event(state)
    assert event["type"] == "finish" and event["finish_reasons"] == ["stop", "abort"]
    assert event["usage"]["completion_tokens"] == 2
    assert event["type"] in protocol.TERMINAL_EVENTS
