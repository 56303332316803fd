"""Engine features beyond greedy equality: logprobs against HF, stop strings, abort, metrics, delay."""

import gc
import time

import pytest
import torch

from inference import LLM, SamplingParams
from inference.request import Request


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    return LLM(model=tiny_model_dir, dtype="float32", max_model_len=256, max_num_batched_tokens=16)


@pytest.fixture(scope="module")
def hf_model(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


def hf_logprobs(hf_model, token_ids):
    with torch.no_grad():
        return torch.log_softmax(hf_model(torch.tensor([token_ids])).logits[0].float(), dim=-1)


def test_prompt_logprobs_match_hf_across_prefill_chunks(llm, hf_model):
    prompt = [(7 * i) % 400 + 10 for i in range(40)]  # 40 tokens: three chunks of the 16-token budget
    out = llm.generate(
        prompt_token_ids=[prompt],
        use_tqdm=False,
        sampling_params=SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=3),
    )[0]
    expected = hf_logprobs(hf_model, prompt)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    for position in range(1, len(prompt)):
        entry = out.prompt_logprobs[position]
        token = prompt[position]
        assert entry[token].logprob == pytest.approx(expected[position - 1, token].item(), abs=1e-4)
        top = sorted((lp for lp in entry.values() if lp.rank <= 3), key=lambda lp: lp.rank)
        assert [lp.rank for lp in top][:3] == [1, 2, 3]


def test_sampled_logprobs_match_hf(llm, hf_model):
    prompt = [11, 12, 13, 14, 15]
    out = llm.generate(
        prompt_token_ids=[prompt],
        use_tqdm=False,
        sampling_params=SamplingParams(temperature=0, max_tokens=6, logprobs=2, ignore_eos=True),
    )[0]
    completion = out.outputs[0]
    expected = hf_logprobs(hf_model, prompt + completion.token_ids)
    for i, token in enumerate(completion.token_ids):
        entry = completion.logprobs[i]
        assert entry[token].rank == 1  # greedy picks the top token
        assert entry[token].logprob == pytest.approx(expected[len(prompt) - 1 + i, token].item(), abs=1e-4)
        assert len(entry) == 2 and all(lp.decoded_token is not None for lp in entry.values())
    assert completion.cumulative_logprob == pytest.approx(
        sum(e[t].logprob for e, t in zip(completion.logprobs, completion.token_ids))
    )


def test_stop_string_cuts_the_text(llm):
    prompt = ["The assert statement"]
    free = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), use_tqdm=False)[0]
    text = free.outputs[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    assert len(stop) == 3
    cut = llm.generate(
        prompt, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=stop), use_tqdm=False
    )[0].outputs[0]
    assert cut.finish_reason == "stop" and cut.stop_reason == stop
    assert cut.text == text[: text.index(stop)]
    kept = llm.generate(
        prompt,
        SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=stop, include_stop_str_in_output=True),
        use_tqdm=False,
    )[0].outputs[0]
    assert kept.text == text[: text.index(stop) + len(stop)]


def test_abort_frees_blocks_at_once(llm):
    engine = llm.llm_engine
    engine.add_request(
        "long", {"prompt_token_ids": list(range(10, 60))}, SamplingParams(max_tokens=100, ignore_eos=True)
    )
    for _ in range(5):
        engine.step()
    assert engine.get_stats()["blocks_used"] > 0
    engine.abort_request("long")
    assert engine.get_stats()["blocks_used"] == 0
    assert not engine.has_unfinished_requests()


def test_ended_requests_leave_no_cyclic_garbage(llm):
    """Finished, forked (n > 1) and aborted requests are freed by their reference counts. Cyclic ones
    wait for a full collection, which in a worker holding a long backlog pauses every stream at once."""
    engine = llm.llm_engine
    gc.collect()
    gc.disable()
    gc.set_debug(gc.DEBUG_SAVEALL)  # what a collection finds stays in gc.garbage to be inspected
    try:
        params = SamplingParams(max_tokens=6, n=2, logprobs=1, ignore_eos=True)
        llm.generate(prompt_token_ids=[list(range(10, 30)), list(range(40, 52))], sampling_params=params)
        engine.add_request("cut", {"prompt_token_ids": list(range(10, 40))}, SamplingParams(max_tokens=50))
        for _ in range(3):
            engine.step()
        engine.abort_request("cut")
        gc.collect()
        cyclic = [obj for obj in gc.garbage if isinstance(obj, Request)]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()
    assert cyclic == []


def test_metrics_count_tokens_and_latencies(tiny_model_dir):
    llm = LLM(model=tiny_model_dir, dtype="float32", max_model_len=256)
    prompts = [[10, 11, 12], [20, 21, 22, 23, 24]]
    llm.generate(
        prompt_token_ids=prompts,
        use_tqdm=False,
        sampling_params=SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
    )
    stats, metrics = llm.llm_engine.get_stats(), llm.llm_engine.metrics
    assert stats["prompt_tokens_total"] == 8 and stats["generation_tokens_total"] == 8
    assert stats["requests_finished_total"] == 2
    histograms = metrics.histograms()
    for name in (
        "time_to_first_token_seconds",
        "e2e_request_latency_seconds",
        "request_queue_time_seconds",
        "time_per_output_token_seconds",
    ):
        assert histograms[name]["count"] == 2 and sum(histograms[name]["counts"]) == 2


def test_scheduler_delay_gathers_a_burst(tiny_model_dir):
    llm = LLM(model=tiny_model_dir, dtype="float32", max_model_len=256, scheduler_delay_ms=300)
    engine = llm.llm_engine
    engine.add_request("a", {"prompt_token_ids": [10, 11]}, SamplingParams(max_tokens=2))
    assert engine.step() == [] and engine.scheduler.num_running == 0  # still gathering
    engine.add_request("b", {"prompt_token_ids": [12, 13]}, SamplingParams(max_tokens=2))
    time.sleep(0.35)
    engine.step()
    assert engine.scheduler.num_running == 2  # both joined the first batch
