"""The engine's histograms and counters (inference/metrics.py): Prometheus' bucket rules and a real engine's counts."""

from __future__ import annotations

import json

from inference import LLM, SamplingParams
from inference.metrics import Histogram, cumulative


def test_a_value_on_a_bound_counts_in_that_bucket_and_cumulative_ends_at_the_count():
    histogram = Histogram(buckets=(0.1, 1.0))
    for value in (0.05, 0.1, 0.5, 1.0, 3.0):
        histogram.observe(value)
    pairs = cumulative(histogram.to_dict())
    assert pairs == [(0.1, 2), (1.0, 4), (float("inf"), 5)]  # Prometheus' le: observations <= the bound
    assert histogram.to_dict()["sum"] == 0.05 + 0.1 + 0.5 + 1.0 + 3.0


def test_a_real_engine_counts_every_finished_request_by_reason(tiny_model_dir):
    llm = LLM(model=tiny_model_dir, dtype="float32", max_model_len=256)
    prompts = [[10, 11, 12], [20, 21, 22, 23], [30, 31]]
    greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    outputs = llm.generate(prompt_token_ids=prompts, sampling_params=greedy, use_tqdm=False)
    first_tokens = [out.outputs[0].token_ids[0] for out in outputs]
    # the first prompt again, stopping on the token it starts with: one "stop" besides the three "length"
    llm.generate(
        prompt_token_ids=[prompts[0]],
        use_tqdm=False,
        sampling_params=SamplingParams(temperature=0, max_tokens=4, stop_token_ids=[first_tokens[0]]),
    )
    snapshot = json.loads(json.dumps(llm.llm_engine.metrics.snapshot()))  # what the heartbeat carries
    assert snapshot["request_success_total"] == {"length": 3, "stop": 1}
    for name in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds"):
        histogram = snapshot["histograms"][name]
        counts = [count for _bound, count in cumulative(histogram)]
        assert counts == sorted(counts) and counts[-1] == histogram["count"] == 4, name
        assert histogram["sum"] > 0
    # time per output token needs a second token: the stopped request had one
    assert snapshot["histograms"]["time_per_output_token_seconds"]["count"] == 3
