"""Tensor parallelism on CPU (gloo): TP=2 greedy outputs equal TP=1, token for token.

Each TP=2 engine spawns one extra process (rank 1); the tests also check that shutdown leaves no
process behind and that a rank killed mid-generation stops the engine with a clear error.
"""

import multiprocessing
import os
import random
import signal
import threading
import time

import pytest

from inference import LLM, SamplingParams
from inference.distributed import TensorParallelError
from inference.multiproc_executor import MultiprocExecutor

# mistral: one KV head, replicated on both ranks; phi3: q/k/v and gate/up fused in the checkpoint, cut per rank
FAMILIES = ["llama", "llama3", "mistral", "qwen2", "phi3", "gemma"]


def prompts_of_lengths(lengths, seed=0, vocab=500):
    rng = random.Random(seed)
    return [[rng.randrange(10, vocab) for _ in range(n)] for n in lengths]


def greedy(max_tokens, **extra):
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **extra)


def run(model_dir, prompts, params, tp, **engine_args):
    llm = LLM(model=model_dir, dtype="float32", max_model_len=256, tensor_parallel_size=tp, **engine_args)
    try:
        return llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False), llm
    finally:
        llm.llm_engine.shutdown()


def token_ids(outputs):
    return [[c.token_ids for c in o.outputs] for o in outputs]


def rank_processes():
    return [p for p in multiprocessing.active_children() if p.name.startswith("tessera-tp-rank")]


@pytest.mark.parametrize("family", FAMILIES)
def test_tp2_greedy_equals_tp1(model_factory, family):
    model_dir = model_factory(family)
    prompts = prompts_of_lengths([1, 9, 40, 70], seed=3)
    single, _ = run(model_dir, prompts, greedy(10), tp=1)
    split, llm = run(model_dir, prompts, greedy(10), tp=2)
    assert token_ids(split) == token_ids(single)
    memory = llm.llm_engine.memory
    assert memory["tensor_parallel_size"] == 2
    assert not rank_processes()


def test_tp2_forks_and_prompt_logprobs_match_tp1(model_factory):
    """n > 1 copies KV blocks on every rank; prompt logprobs gather the vocab-parallel head."""
    model_dir = model_factory("llama")
    prompts = prompts_of_lengths([21, 5], seed=4)
    params = SamplingParams(n=2, temperature=0.8, seed=7, max_tokens=6, prompt_logprobs=2, ignore_eos=True)
    single, _ = run(model_dir, prompts, params, tp=1, block_size=8)
    split, _ = run(model_dir, prompts, params, tp=2, block_size=8)
    assert token_ids(split) == token_ids(single)
    for a, b in zip(single, split):
        assert len(a.prompt_logprobs) == len(b.prompt_logprobs) > 1
        for pa, pb in zip(a.prompt_logprobs, b.prompt_logprobs):
            if pa is None:  # the first prompt token has no logprob
                assert pb is None
                continue
            assert pa.keys() == pb.keys()
            assert all(abs(pa[t].logprob - pb[t].logprob) < 1e-4 for t in pa)


def test_tp2_holds_half_the_weights_and_kv_per_block(model_factory):
    model_dir = model_factory("llama")
    single = LLM(model=model_dir, dtype="float32", max_model_len=256, num_kv_blocks=64).llm_engine
    split = LLM(
        model=model_dir, dtype="float32", max_model_len=256, num_kv_blocks=64, tensor_parallel_size=2
    ).llm_engine
    try:
        assert split.memory["kv_pool_bytes"] * 2 == single.memory["kv_pool_bytes"]  # 2 KV heads -> 1 per rank
        assert split.memory["weights_bytes"] < 0.6 * single.memory["weights_bytes"]
    finally:
        split.shutdown()
    procs = split.executor.procs
    assert procs and all(not p.is_alive() for p in procs)
    for p in procs:
        with pytest.raises(ProcessLookupError):
            os.kill(p.pid, 0)
    assert not rank_processes()


@pytest.mark.timeout(90)
def test_killed_rank_stops_the_engine_with_a_clear_error(model_factory):
    model_dir = model_factory("llama")
    llm = LLM(model=model_dir, dtype="float32", max_model_len=512, tensor_parallel_size=2)
    engine = llm.llm_engine
    victim = engine.executor.procs[0]
    prompts = prompts_of_lengths([30] * 4, seed=5)
    # Kill rank 1 while the engine is generating (between or inside collectives, either is fine).
    timer = threading.Timer(1.0, os.kill, (victim.pid, signal.SIGKILL))
    timer.start()
    try:
        with pytest.raises(TensorParallelError, match="rank 1"):
            for _ in range(200):
                llm.generate(prompt_token_ids=prompts, sampling_params=greedy(100), use_tqdm=False)
    finally:
        timer.cancel()
        engine.shutdown()
    assert not rank_processes()
    with pytest.raises(TensorParallelError):  # the engine stays stopped, it does not hang
        llm.generate(prompt_token_ids=prompts[:1], sampling_params=greedy(2), use_tqdm=False)


def test_tensor_parallel_size_must_divide_heads(model_factory):
    model_dir = model_factory("llama")  # 4 attention heads
    with pytest.raises(ValueError, match="not divisible by tensor_parallel_size 3"):
        LLM(model=model_dir, dtype="float32", max_model_len=256, tensor_parallel_size=3)
    assert not rank_processes()


def test_a_rank_that_dies_before_joining_fails_the_start_at_once():
    """Rank 0 waits for each spawned rank's 'joining' word or its death, not for the group timeout."""
    ctx = multiprocessing.get_context("spawn")
    reader, writer = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=os._exit, args=(3,), name="tessera-tp-rank1")
    proc.start()
    writer.close()
    executor = object.__new__(MultiprocExecutor)  # only the start-up handshake, no group
    executor.procs = [proc]
    started = time.monotonic()
    with pytest.raises(TensorParallelError, match=r"rank 1 \(pid \d+\) exited with code 3 before joining"):
        executor._wait_until_joining([reader])
    assert time.monotonic() - started < 30
