"""Scheduling benchmarks (issue 3): prefix caching, chunked prefill under priority, KV capacity."""

from __future__ import annotations

import argparse
import random
import statistics
import time

from benchmarks.common import Timer, bench_model_dir, machine_line, print_table, random_workload
from inference import LLM, SamplingParams


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def shared_prefix(requests: int) -> str:
    """A common 384-token system prefix + 32..128 unique tokens, 64 output tokens each."""
    rng = random.Random(1)
    prefix = [rng.randrange(3, 8192) for _ in range(384)]
    prompts = [prefix + [rng.randrange(3, 8192) for _ in range(rng.randint(32, 128))] for _ in range(requests)]
    rows = []
    results = {}
    for caching in (False, True):
        llm = LLM(model=bench_model_dir(), dtype="float32", max_model_len=1024, enable_prefix_caching=caching)
        with Timer() as t:
            outs = llm.generate(prompt_token_ids=prompts, sampling_params=greedy(64))
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        stats = llm.llm_engine.get_stats()
        results[caching] = tokens / t.seconds
        rows.append(
            [
                "on" if caching else "off",
                t.seconds,
                tokens / t.seconds,
                f"{stats['prefix_cache_hit_rate'] * 100:.1f}%",
                stats["prompt_tokens_total"],
            ]
        )
    rows.append(["ratio on/off", "", results[True] / results[False], "", ""])
    return print_table(
        f"Shared prefix: {requests} requests, 384-token common prefix + 32..128 unique, 64 output tokens",
        ["prefix caching", "seconds", "output tok/s", "hit rate", "prompt tokens computed"],
        rows,
    )


def run_mixed(chunked: bool, shorts: int, rate: float) -> list[float]:
    """8 long low-priority prompts, then Poisson arrivals of short high-priority ones; their TTFTs."""
    args = (
        dict(max_num_batched_tokens=256, enable_chunked_prefill=True)
        if chunked
        else dict(max_num_batched_tokens=2048, enable_chunked_prefill=False)
    )
    llm = LLM(model=bench_model_dir(), dtype="float32", max_model_len=2048, **args)
    engine = llm.llm_engine
    rng = random.Random(2)
    for i in range(8):
        engine.add_request(
            f"long{i}", {"prompt_token_ids": [rng.randrange(3, 8192) for _ in range(2000)]}, greedy(16), priority=10
        )
    start = time.monotonic()
    arrivals, t = [], 0.0
    for _ in range(shorts):
        t += rng.expovariate(rate)
        arrivals.append(t)
    pending = list(enumerate(arrivals))
    ttfts = {}
    while pending or engine.has_unfinished_requests():
        now = time.monotonic() - start
        while pending and pending[0][1] <= now:
            i, _ = pending.pop(0)
            engine.add_request(
                f"short{i}", {"prompt_token_ids": [rng.randrange(3, 8192) for _ in range(32)]}, greedy(16), priority=0
            )
        if not engine.has_unfinished_requests():
            time.sleep(0.001)
            continue
        for out in engine.step():
            m = out.metrics
            if out.request_id.startswith("short") and out.request_id not in ttfts and m.first_token_time:
                ttfts[out.request_id] = m.first_token_time - m.arrival_time
    return sorted(ttfts.values())


def percentile(values: list[float], p: float) -> float:
    return values[min(len(values) - 1, int(round(p / 100 * (len(values) - 1))))]


def mixed_priority(shorts: int, rate: float) -> str:
    rows, p99 = [], {}
    for chunked in (False, True):
        ttfts = run_mixed(chunked, shorts, rate)
        p99[chunked] = percentile(ttfts, 99)
        rows.append(
            [
                "on (budget 256)" if chunked else "off (budget 2048)",
                len(ttfts),
                statistics.median(ttfts) * 1000,
                p99[chunked] * 1000,
            ]
        )
    rows.append(["p99 ratio off/on", "", "", p99[False] / p99[True]])
    return print_table(
        f"Mixed: 8 low-priority 2000-token prompts + {shorts} short high-priority (Poisson {rate}/s)",
        ["chunked prefill", "short requests", "p50 TTFT ms", "p99 TTFT ms"],
        rows,
    )


def capacity(kv_blocks: int) -> str:
    """Peak concurrently running sequences at a fixed pool vs reserving max_model_len each."""
    max_model_len, block_size = 2048, 16
    llm = LLM(
        model=bench_model_dir(),
        dtype="float32",
        max_model_len=max_model_len,
        num_kv_blocks=kv_blocks,
        block_size=block_size,
        max_num_seqs=512,
    )
    engine = llm.llm_engine
    for i, (prompt, n) in enumerate(random_workload(512, (32, 512), (32, 256), seed=3)):
        engine.add_request(str(i), {"prompt_token_ids": prompt}, greedy(n))
    peak = 0
    for _ in range(40):  # the peak is reached while the first wave is admitted
        engine.step()
        peak = max(peak, engine.scheduler.num_running)
    engine.abort_request([str(i) for i in range(512)])
    contiguous = kv_blocks * block_size // max_model_len
    return print_table(
        f"Capacity at a fixed KV pool of {kv_blocks} blocks x {block_size} tokens (max_model_len {max_model_len})",
        ["paged: peak running sequences", "contiguous max_model_len reservation", "ratio"],
        [[peak, contiguous, peak / contiguous]],
    )


def main(argv=None) -> str:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--shorts", type=int, default=40)
    parser.add_argument("--rate", type=float, default=4.0)
    parser.add_argument("--kv-blocks", type=int, default=2048)
    args = parser.parse_args(argv)
    print(machine_line())
    return "\n".join([shared_prefix(args.requests), mixed_priority(args.shorts, args.rate), capacity(args.kv_blocks)])


if __name__ == "__main__":
    main()
