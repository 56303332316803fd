"""One request's failure fails that request alone; a failed forward fails its batch, not the engine.

Faults are injected into one request of a running batch at the real seams (its detokenizer, its
sampling parameters, its generator, the executor's forward); every other request must finish
with the same tokens as in a run without the fault, and the failed one must give its blocks back.
"""

from __future__ import annotations

import pytest
import torch
from django.conf import settings

from inference import LLM, SamplingParams
from inference.detokenizer import IncrementalDetokenizer
from tests.inference.worker_helpers import MODEL, ThreadedWorker, llm, r, wait_for  # noqa: F401 (fixtures)

PROMPTS = {"a": [5, 6, 7, 8], "b": [9, 10, 11], "c": [12, 13, 14, 15, 16], "d": [17, 18]}
PARAMS = {
    "a": dict(temperature=0.0),
    "b": dict(temperature=0.9, seed=1),
    "c": dict(temperature=0.9, seed=2, logprobs=2),
    "d": dict(temperature=0.7, seed=3, n=2),
}


@pytest.fixture(scope="module")
def offline(tiny_model_dir):
    return LLM(model=tiny_model_dir, dtype="float32", device="cpu", max_model_len=256, seed=0)


@pytest.fixture
def engine(offline):
    return offline.llm_engine


def run_batch(engine, max_tokens=10, inject=None) -> dict:
    """Run PROMPTS as one batch to the end; inject(engine) runs after the third step."""
    for rid, prompt in PROMPTS.items():
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, **PARAMS[rid])
        engine.add_request(rid, {"prompt_token_ids": prompt}, params)
    outputs, steps = {}, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out
        steps += 1
        if steps == 3 and inject is not None:
            inject(engine)
    return outputs


def tokens_of(out) -> list[list[int]]:
    return [c.token_ids for c in out.outputs]


class BrokenAfter(IncrementalDetokenizer):
    """A detokenizer that raises on its n-th token (like a tokenizer that chokes on one id)."""

    def __init__(self, base: IncrementalDetokenizer, n: int):
        self.__dict__.update(base.__dict__)
        self.left = n

    def add_token(self, token_id, check_stop=True):
        self.left -= 1
        if self.left < 0:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected bad byte")
        return super().add_token(token_id, check_stop)


class ExhaustedGenerator:
    """A generator that can save and restore its state but fails when drawn from."""

    device = torch.device("cpu")

    def get_state(self):
        return torch.zeros(1, dtype=torch.uint8)

    def set_state(self, state):
        pass


def assert_others_unchanged(clean: dict, faulty: dict, failed: str):
    assert set(faulty) == set(clean)
    for rid in clean:
        if rid != failed:
            assert faulty[rid].error is None
            assert tokens_of(faulty[rid]) == tokens_of(clean[rid]), rid


def assert_blocks_returned(engine):
    assert not engine.kv.tables and engine.get_stats()["blocks_used"] == 0
    assert not engine.has_unfinished_requests() and not engine.requests


def test_a_detokenizer_failure_fails_only_its_request(engine):
    clean = run_batch(engine)

    def break_b(eng):
        eng.requests["b"].detok = BrokenAfter(eng.requests["b"].detok, 2)

    faulty = run_batch(engine, inject=break_b)
    failed = faulty["b"]
    assert failed.finished and failed.outputs[0].finish_reason == "error"
    assert "detokenization failed: UnicodeDecodeError" in failed.error and "injected bad byte" in failed.error
    assert len(failed.outputs[0].token_ids) < 10
    assert_others_unchanged(clean, faulty, "b")
    assert_blocks_returned(engine)


def test_a_sampling_failure_fails_only_its_request(engine):
    clean = run_batch(engine)

    def break_c(eng):  # a bad per-request value inside the batched sampler
        eng.requests["c"].params.repetition_penalty = "1.2"

    faulty = run_batch(engine, inject=break_c)
    assert faulty["c"].error.startswith("sampling failed: TypeError")
    assert_others_unchanged(clean, faulty, "c")
    assert_blocks_returned(engine)


def test_a_stop_check_failure_fails_only_its_request(engine):
    clean = run_batch(engine)

    def break_a(eng):  # corrupt state that only the scheduler's stop checks read
        eng.requests["a"].params.stop_token_ids = None

    faulty = run_batch(engine, inject=break_a)
    assert faulty["a"].error.startswith("stop checks failed: TypeError")
    assert_others_unchanged(clean, faulty, "a")
    assert_blocks_returned(engine)


def test_a_prompt_logprobs_failure_fails_only_its_request(engine, monkeypatch):
    clean = run_batch(engine)
    real = engine._prompt_logprobs_of

    def failing_for_c(request, hidden_rows, first_pos):
        if request.request_id == "c":
            raise IndexError("injected")
        return real(request, hidden_rows, first_pos)

    monkeypatch.setattr(engine, "_prompt_logprobs_of", failing_for_c)
    for rid in PROMPTS:  # every request asks for prompt logprobs; only c's computation fails
        PARAMS[rid]["prompt_logprobs"] = 1
    try:
        faulty = run_batch(engine)
    finally:
        for rid in PROMPTS:
            del PARAMS[rid]["prompt_logprobs"]
    assert faulty["c"].error == "prompt logprobs failed: IndexError: injected"
    assert faulty["c"].outputs[0].token_ids == []  # it failed in its prefill step, before sampling
    assert_others_unchanged(clean, faulty, "c")
    assert all(len(faulty[rid].prompt_logprobs) == len(PROMPTS[rid]) for rid in PROMPTS if rid != "c")
    assert_blocks_returned(engine)


def test_a_failure_after_other_rows_drew_their_noise_keeps_their_tokens(engine):
    """The batch is re-sampled row by row with every generator rewound, so seeded rows are unchanged."""
    clean = run_batch(engine)

    def break_d(eng):  # d's sequences come after a, b and c in the batch
        for seq in eng.requests["d"].group:
            seq.generator = ExhaustedGenerator()

    faulty = run_batch(engine, inject=break_d)
    assert faulty["d"].error.startswith("sampling failed: TypeError")
    assert all(c.finish_reason == "error" for c in faulty["d"].outputs)
    assert_others_unchanged(clean, faulty, "d")
    assert_blocks_returned(engine)


def test_a_forward_failure_fails_the_batch_and_the_engine_serves_on(engine, monkeypatch):
    clean = run_batch(engine)
    real_execute = engine.executor.execute
    calls = {"n": 0}

    def execute_failing_once(inputs):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("injected device fault")
        return real_execute(inputs)

    monkeypatch.setattr(engine.executor, "execute", execute_failing_once)
    failed = run_batch(engine, inject=None)
    assert set(failed) == set(PROMPTS)
    for out in failed.values():
        assert out.error == "the forward pass failed: RuntimeError: injected device fault"
        assert all(c.finish_reason == "error" and c.token_ids == [] for c in out.outputs)
    assert_blocks_returned(engine)
    assert {rid: tokens_of(out) for rid, out in run_batch(engine).items()} == {
        rid: tokens_of(out) for rid, out in clean.items()
    }


def test_a_fatal_error_is_not_swallowed_as_one_requests_failure(engine, monkeypatch):
    """A dead tensor-parallel rank is nobody's fault in particular: it stops the engine (the worker exits)."""
    from inference.distributed import TensorParallelError

    def dead_rank(inputs):
        raise TensorParallelError("tensor-parallel rank 1 died")

    monkeypatch.setattr(engine.executor, "execute", dead_rank)
    engine.add_request("fatal", {"prompt_token_ids": PROMPTS["a"]}, SamplingParams(max_tokens=2))
    with pytest.raises(TensorParallelError):
        engine.step()
    engine.abort_request("fatal")
    assert_blocks_returned(engine)


def test_offline_generate_returns_a_failed_request_and_does_not_hang(offline, engine, monkeypatch):
    llm = offline
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    expected = llm.generate(prompt_token_ids=[PROMPTS["a"], PROMPTS["b"]], sampling_params=params, use_tqdm=False)
    real = engine._detokenizer
    monkeypatch.setattr(
        engine,
        "_detokenizer",
        lambda req: BrokenAfter(real(req), 1) if req.prompt_token_ids == PROMPTS["b"] else real(req),
    )
    outs = llm.generate(prompt_token_ids=[PROMPTS["a"], PROMPTS["b"]], sampling_params=params, use_tqdm=False)
    assert outs[0].error is None and outs[0].outputs[0].token_ids == expected[0].outputs[0].token_ids
    assert outs[1].error.startswith("detokenization failed") and outs[1].outputs[0].finish_reason == "error"
    monkeypatch.undo()
    again = llm.generate(prompt_token_ids=[PROMPTS["b"]], sampling_params=params, use_tqdm=False)[0]
    assert again.outputs[0].token_ids == expected[1].outputs[0].token_ids
    assert_blocks_returned(engine)


def test_the_worker_sends_engine_error_to_the_failed_request_alone(llm, r, monkeypatch):  # noqa: F811
    """Through the worker and Redis: the failing request's stream ends with engine_error; the other finishes."""
    from engine_client import client as engine_client

    client = engine_client.client()
    engine = llm.llm_engine
    greedy = {"temperature": 0.0, "max_tokens": 8, "ignore_eos": True}
    expected = (
        llm.generate(prompt_token_ids=[PROMPTS["a"]], use_tqdm=False, sampling_params=SamplingParams(**greedy))[0]
        .outputs[0]
        .token_ids
    )
    real = engine._detokenizer
    monkeypatch.setattr(
        engine,
        "_detokenizer",
        lambda req: BrokenAfter(real(req), 3) if req.prompt_token_ids == PROMPTS["b"] else real(req),
    )
    running = ThreadedWorker(engine, settings.REDIS_URL).start()
    try:
        good = client.submit(model=MODEL, prompt_token_ids=PROMPTS["a"], sampling_params=greedy)
        bad = client.submit(model=MODEL, prompt_token_ids=PROMPTS["b"], sampling_params=greedy)
        bad_events = list(client.stream(bad, timeout=30))
        good_events = list(client.stream(good, timeout=30))
    finally:
        running.stop()
    assert bad_events[-1]["type"] == "error" and bad_events[-1]["code"] == "engine_error"
    assert "detokenization failed: UnicodeDecodeError" in bad_events[-1]["message"]
    assert good_events[-1]["type"] == "finish" and good_events[-1]["finish_reasons"] == ["length"]
    assert [t for e in good_events if e["type"] == "delta" for t in e["token_ids"]] == expected
    assert running.worker.counters["errors_total"] == 1
    wait_for(lambda: not engine.has_unfinished_requests())
    assert engine.get_stats()["blocks_used"] == 0
