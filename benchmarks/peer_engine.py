"""One engine, one workload, in a process of its own: what benchmarks/peers.py runs for each engine.

    python benchmarks/peer_engine.py --engine tessera|vllm --model DIR --dtype float32 --workload work.json
    python benchmarks/peer_engine.py --engine tessera --model FILE.gguf --dtype packed --workload work.json

Prints one line `RESULT {json}`: output tokens, seconds and tok/s of the whole workload (greedy,
ignore_eos, every request submitted at once), then batch 1: TTFT (median time of a max_tokens=1
request) and TPOT (the extra time of 1 + SINGLE_TOKENS tokens, per token), and the KV figures the
engine reports (Tessera's with its KV pool's size). Tessera and vLLM share the offline API, so the
same lines drive both; under vLLM's venv nothing of Tessera is imported. dtype `packed` (Tessera only)
loads a GGUF file's blocks as they are, `packed-bfloat16` the same with bfloat16 activations and KV cache.
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time

PACKED = {"packed": {"weights": "packed"}, "packed-bfloat16": {"weights": "packed", "dtype": "bfloat16"}}
SINGLE_TOKENS = 128  # batch-1 probe: decode length and repeats
SINGLE_REPEATS = 3


def load_engine(engine: str, model: str, dtype: str):
    if engine == "vllm":
        from vllm import LLM, SamplingParams  # noqa: F401  (vLLM's venv only)

        llm = LLM(model=model, dtype=dtype, max_model_len=1024, seed=0, disable_log_stats=False)
    else:
        from inference import LLM, SamplingParams  # noqa: F401

        # "packed": a GGUF file's blocks as they are (the engine's weights option, not a float dtype);
        # "packed-bfloat16": the same with bfloat16 activations and KV cache
        weights = PACKED.get(dtype, {"dtype": dtype})
        llm = LLM(model=model, max_model_len=1024, seed=0, **weights)
    return llm, SamplingParams


def timed_generate(llm, prompts: list[list[int]], params) -> tuple[float, list]:
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return time.perf_counter() - start, outs


def run_workload(llm, SamplingParams, work: list) -> dict:
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for _, n in work]
    timed_generate(llm, [work[0][0]], params[0])  # warm-up: first-call compilation and caches
    seconds, outs = timed_generate(llm, [p for p, _ in work], params)
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"tokens": tokens, "seconds": seconds, "tok_s": tokens / seconds}


def vllm_peak_kv_usage(llm, done: threading.Event, peak: dict) -> None:
    """vLLM's own gauge (fraction of KV blocks in use), sampled while the workload runs."""
    while not done.wait(0.05):
        for metric in llm.get_metrics():
            if metric.name == "vllm:kv_cache_usage_perc":
                peak["vllm_kv_blocks_used_at_peak"] = max(peak.get("vllm_kv_blocks_used_at_peak", 0.0), metric.value)


def run_single(llm, SamplingParams, prompt: list[int]) -> dict:
    """Batch 1. Every call starts with its own first token, so no prefix-cache hit flatters the TTFT."""
    first = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    longer = SamplingParams(temperature=0.0, max_tokens=1 + SINGLE_TOKENS, ignore_eos=True)
    ttfts, totals = [], []
    for i in range(SINGLE_REPEATS):  # the workload's ids start at 3; 3..8 never repeat a prefix here
        ttfts.append(timed_generate(llm, [[3 + 2 * i] + prompt[1:]], first)[0])
        totals.append(timed_generate(llm, [[4 + 2 * i] + prompt[1:]], longer)[0])
    ttft = statistics.median(ttfts)
    return {"ttft_ms": ttft * 1000, "tpot_ms": (statistics.median(totals) - ttft) / SINGLE_TOKENS * 1000}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engine", choices=["tessera", "vllm"], required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument(
        "--workload",
        required=True,
        help='JSON {"requests": [[prompt_token_ids, output_len], ...], "single_prompt": [...]}',
    )
    args = parser.parse_args()
    work = json.loads(open(args.workload).read())
    llm, SamplingParams = load_engine(args.engine, args.model, args.dtype)
    kv, done = {}, threading.Event()
    if args.engine == "vllm":
        threading.Thread(target=vllm_peak_kv_usage, args=(llm, done, kv), daemon=True).start()
    result = run_workload(llm, SamplingParams, work["requests"])
    done.set()
    if args.engine == "tessera":
        kv = {
            "kv_fill_at_peak": llm.llm_engine.metrics.kv_fill_at_peak,
            "kv_blocks_used_at_peak": llm.llm_engine.metrics.peak_allocated_slots
            / (llm.llm_engine.kv.pool.num_blocks * llm.llm_engine.kv.block_size),
            "kv_pool_bytes": llm.llm_engine.memory["kv_pool_bytes"],
            "dtype": str(llm.llm_engine.dtype).removeprefix("torch."),  # activations and KV cache
        }
    result.update(kv)
    result.update(run_single(llm, SamplingParams, work["single_prompt"]))
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":  # vLLM starts its engine core with spawn: nothing may run at import
    main()
