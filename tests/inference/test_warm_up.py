"""The engine's warm-up: one short prefill and decode before the worker's first heartbeat, so the first
request after `ready:` does not pay for what loads on first use (issue #32)."""

from __future__ import annotations

import threading

import pytest
import redis
from django.conf import settings
from test_gguf import write_gguf
from tiny_models import make_tiny_model

from inference import LLM, SamplingParams, protocol
from tessera_kernels import quant_cpu
from tests.inference.worker_helpers import ThreadedWorker, clear_engine_keys, tiny_llm, wait_for

PROMPT = [5, 17, 42, 99, 7, 3]


@pytest.fixture
def fresh_llm(tiny_model_dir):
    return tiny_llm(tiny_model_dir)


def greedy(llm, prompt=PROMPT, max_tokens=8):
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return llm.generate(prompt_token_ids=[prompt], sampling_params=params, use_tqdm=False)[0].outputs[0].token_ids


def test_the_worker_warms_the_engine_up_before_its_first_heartbeat(fresh_llm):
    engine = fresh_llm.llm_engine
    assert engine.warmed_up_at is None, "a bare engine has not warmed up: the worker must do it"
    r = redis.Redis.from_url(settings.REDIS_URL)
    clear_engine_keys(r)
    # one heartbeat in the test's time (the interval is long): the hash read is the one join() wrote
    running = ThreadedWorker(engine, settings.REDIS_URL, heartbeat_interval=600, heartbeat_ttl=1200).start()
    try:
        key = protocol.heartbeat_key(running.worker.worker_id)
        wait_for(lambda: r.exists(key), timeout=300)
        first_heartbeat_at = float(r.hget(key, "updated_at"))
        assert engine.warmed_up_at is not None and engine.warmed_up_at <= first_heartbeat_at
    finally:
        running.stop()
        clear_engine_keys(r)


def test_warm_up_leaves_no_trace_in_the_pool_the_metrics_or_the_outputs(fresh_llm, tiny_model_dir):
    engine = fresh_llm.llm_engine
    engine.warm_up()
    assert engine.warmed_up_at is not None
    stats = engine.get_stats()
    assert stats["blocks_used"] == 0 and stats["prompt_tokens_total"] == 0
    assert set(engine.kv.pool.state_codes()) == {0}, "no block is held or named as a cached prefix"
    assert greedy(fresh_llm) == greedy(tiny_llm(tiny_model_dir)), "warm-up's K/V never shows in a request"


def test_warm_up_after_requests_keeps_the_cached_prefixes(fresh_llm):
    expected = greedy(fresh_llm, PROMPT * 6)  # its full blocks stay cached after it finishes
    cached = engine_cached_blocks(fresh_llm)
    assert cached, "the first request left cached prefix blocks"
    fresh_llm.llm_engine.warm_up()
    assert engine_cached_blocks(fresh_llm) == cached
    assert greedy(fresh_llm, PROMPT * 6) == expected


def engine_cached_blocks(llm) -> list[int]:
    return [block for block, state in enumerate(llm.llm_engine.kv.pool.state_codes()) if state == 1]


def test_warm_up_runs_the_packed_linears_dequantized_path_too(tmp_path):
    """A chat prompt is longer than the rows from which a packed linear dequantizes to bfloat16 (32 on the
    decoded path, as Q3_K's rows always run; AMX's tiles from 32 for interleaved rows where the CPU has AMX):
    the warm-up's prefill reaches them, so that path's first use (its scratch buffer, oneDNN's kernels) is not the first
    request's."""
    hf_dir = make_tiny_model(tmp_path / "hf", "qwen2", hidden_size=256, intermediate_size=256)
    file = str(write_gguf(hf_dir, tmp_path / "tiny.gguf", ("Q4_K", "Q3_K")))
    engine = LLM(model=file, device="cpu", max_model_len=256, num_kv_blocks=64).llm_engine
    crossovers = (quant_cpu.DEQUANTIZE_FROM_ROWS, quant_cpu.TILES_FROM_ROWS)
    assert engine.WARM_UP_PROMPT_TOKENS >= max(crossovers)
    scratch = []
    warm = threading.Thread(target=lambda: (engine.warm_up(), scratch.append(hasattr(quant_cpu._scratch, "buffer"))))
    warm.start()  # a thread of its own: its scratch buffer is the warm-up's alone
    warm.join()
    assert scratch == [True]
