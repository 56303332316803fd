"""Fair share under overload (issue 34), engine level: FCFS and `fair` alternating on one workload.

Two tenants, B arriving at twice A's rate, fixed prompt and output lengths, the engine's batch kept
full (max_num_seqs small) so both stay backlogged; then four tenants with weights 1:2:3:4. Service is
the paper's weighted tokens (prompt x1 when the first token comes, output x2 as they come).

This runs the bare engine in this process (no web tier, Redis or worker): the served-stack version the
issue asks for is still to be built (docs/benchmarks.md says so).
"""

from __future__ import annotations

import argparse
import itertools
import random
import statistics
import time

from benchmarks.common import bench_model_dir, print_table
from inference import LLM, SamplingParams
from inference.fairness import service_bound


def run(
    policy: str,
    rates: dict[str, float],
    weights: dict[str, float],
    seconds: float,
    prompt_len: int,
    output_len: int,
    max_num_seqs: int,
) -> dict:
    llm = LLM(
        model=bench_model_dir(),
        dtype="float32",
        max_model_len=1024,
        max_num_seqs=max_num_seqs,
        scheduling_policy=policy,
    )
    engine = llm.llm_engine
    rng = random.Random(0)
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    next_arrival = {tenant: 0.0 for tenant in rates}
    ids = itertools.count()
    tenant_of, sent_at, seen, ttft = {}, {}, {}, {tenant: [] for tenant in rates}
    served = {tenant: 0.0 for tenant in rates}
    max_diff, tokens, start = 0.0, 0, time.monotonic()
    while (now := time.monotonic() - start) < seconds:
        for tenant, rate in rates.items():
            while next_arrival[tenant] <= now:
                rid = str(next(ids))
                prompt = [rng.randrange(3, 8192) for _ in range(prompt_len)]
                engine.add_request(rid, {"prompt_token_ids": prompt}, params, tenant=tenant, weight=weights[tenant])
                tenant_of[rid], sent_at[rid] = tenant, time.monotonic()
                next_arrival[tenant] += rng.expovariate(rate)
        for out in engine.step():
            tenant, new = tenant_of[out.request_id], len(out.outputs[0].token_ids) - seen.get(out.request_id, 0)
            if new and out.request_id not in seen:
                ttft[tenant].append((time.monotonic() - sent_at[out.request_id]) * 1000)
                served[tenant] += prompt_len
            seen[out.request_id] = seen.get(out.request_id, 0) + new
            served[tenant] += 2 * new
            tokens += new
        if len(rates) == 2:
            a, b = (served[t] / weights[t] for t in rates)
            max_diff = max(max_diff, abs(a - b))
    elapsed = time.monotonic() - start
    kv_tokens = engine.kv.pool.num_blocks * engine.kv.block_size
    engine.abort_request(list(engine.requests))
    return {
        "served": served,
        "max_diff": max_diff,
        "tok_s": tokens / elapsed,
        "ttft": ttft,
        "bound": service_bound(prompt_len, min(kv_tokens, max_num_seqs * (prompt_len + output_len))),
    }


def pct(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100)[q - 1] if len(values) > 1 else float("nan")


def main(argv: list[str]) -> str:
    parser = argparse.ArgumentParser(prog="fairness")
    parser.add_argument("--seconds", type=float, default=180.0)
    parser.add_argument("--rate", type=float, default=4.0, help="A's requests/s (B sends twice as many)")
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--output", type=int, default=32)
    parser.add_argument("--max-num-seqs", type=int, default=8)
    args = parser.parse_args(argv)
    rows = []
    for policy in ("fcfs", "fair"):
        result = run(
            policy,
            {"A": args.rate, "B": 2 * args.rate},
            {"A": 1.0, "B": 1.0},
            args.seconds,
            args.prompt,
            args.output,
            args.max_num_seqs,
        )
        served, ttft = result["served"], result["ttft"]
        rows.append(
            [
                policy,
                round(served["A"]),
                round(served["B"]),
                served["B"] / max(served["A"], 1.0),
                round(result["max_diff"]),
                round(result["bound"]),
                result["tok_s"],
                pct(ttft["A"], 50),
                pct(ttft["A"], 99),
                pct(ttft["B"], 50),
                pct(ttft["B"], 99),
            ]
        )
    tables = [
        print_table(
            f"Two tenants, B at 2x A's rate ({args.rate}/s and {2 * args.rate}/s), prompt {args.prompt}, output "
            f"{args.output}, max_num_seqs {args.max_num_seqs}, {args.seconds:.0f} s each (bare engine)",
            [
                "policy",
                "W_A",
                "W_B",
                "W_B/W_A",
                "max |W_A-W_B|",
                "2U",
                "output tok/s",
                "A TTFT p50 ms",
                "A p99",
                "B TTFT p50 ms",
                "B p99",
            ],
            rows,
        )
    ]
    weights = {"w1": 1.0, "w2": 2.0, "w3": 3.0, "w4": 4.0}
    result = run(
        "fair", {t: 2 * args.rate for t in weights}, weights, args.seconds, args.prompt, args.output, args.max_num_seqs
    )
    total = sum(result["served"].values())
    tables.append(
        print_table(
            "Four tenants, weights 1:2:3:4, each at 2x A's rate (fair)",
            ["tenant", "weight", "share", "target"],
            [[t, w, result["served"][t] / total, w / 10] for t, w in weights.items()],
        )
    )
    return "\n".join(tables)


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
