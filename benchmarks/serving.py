"""Serving benchmark in the method of vLLM's benchmark_serving: Poisson arrivals through the HTTP API.

For each request rate (requests/s; "inf" sends everything at once) the same workload is sent as
streaming /v1/completions requests with Poisson (exponential inter-arrival) timing. Reported:
request throughput, output tokens/s, TTFT, TPOT (time per output token after the first) and ITL
(gaps between streamed chunks), mean / p50 / p99. The bare engine runs the same workload
offline (LLM.generate) first, so the table shows what the web tier + Redis + worker cost:
served output tok/s at saturation vs the bare engine's, and the p50 TTFT the stack adds at low load,
measured on the first PROBE_REQUESTS prompts sent one at a time to an idle engine (in-process for
the bare engine, over HTTP for the stack). The client is aiohttp, as in vLLM's benchmark.

    python benchmarks/serving.py                       # small defaults, launches its own stack
    python benchmarks/serving.py --base-url http://127.0.0.1:8000 --api-key tsk-... --model-name tessera-demo
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO_DIR = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO_DIR), str(REPO_DIR / "platform")]

from benchmarks.common import BENCH_DIR, bench_model_dir, machine_line, print_table, random_workload  # noqa: E402

# Complete on purpose: the live stack's own test defaults (a 128-block pool) must not leak in, or
# the served engine would queue and preempt where the bare one does not. Prefix caching is off:
# every rate replays the same prompts, and cache hits from the previous rate would flatter the next.
ENGINE_ARGS = {"dtype": "float32", "device": "cpu", "block_size": 16, "max_model_len": 1024, "max_num_seqs": 64,
               "max_num_batched_tokens": 2048, "num_kv_blocks": None, "enable_prefix_caching": False, "seed": 0}


PROBE_REQUESTS = 16  # idle-TTFT probe: this many prompts of the workload, one at a time
PROBE_TOKENS = 4


@dataclass
class RequestResult:
    ok: bool
    prompt_len: int
    output_tokens: int = 0
    ttft: float | None = None
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    error: str = ""


# ---------------------------------------------------------------- the bare engine

def offline_baseline(model_dir: str, work, probe_prompts) -> dict:
    """Offline throughput on the same workload, and idle-engine TTFT (the no-stack reference).

    The workload runs twice and the second run counts: the served engine has run it too (at the
    lower rates) before its saturated rate, so both have built their oneDNN GEMM primitives.
    """
    from inference import LLM, SamplingParams

    llm = LLM(model=model_dir, **ENGINE_ARGS)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for _, n in work]
    llm.generate(prompt_token_ids=[p for p, _ in work], sampling_params=params, use_tqdm=False)  # warm-up
    started = time.perf_counter()
    outs = llm.generate(prompt_token_ids=[p for p, _ in work], sampling_params=params)
    seconds = time.perf_counter() - started
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"output_tokens": tokens, "seconds": seconds, "output_tok_s": tokens / seconds,
            "idle_ttft_p50_ms": statistics.median(_bare_ttft(llm, p) for p in probe_prompts) * 1000}


def _bare_ttft(llm, prompt) -> float:
    from inference import SamplingParams

    engine = llm.llm_engine
    started = time.perf_counter()
    engine.add_request("ttft-probe", {"prompt_token_ids": prompt},
                       SamplingParams(temperature=0.0, max_tokens=PROBE_TOKENS, ignore_eos=True))
    first = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if first is None and out.outputs and out.outputs[0].token_ids:
                first = time.perf_counter() - started
    return first or 0.0


# ---------------------------------------------------------------- the served stack

async def one_request(session, url: str, headers: dict, model: str, prompt, max_tokens: int) -> RequestResult:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    result = RequestResult(ok=False, prompt_len=len(prompt))
    started = last = time.perf_counter()
    try:
        async with session.post(url, json=body, headers=headers) as response:
            if response.status != 200:
                result.error = f"HTTP {response.status}: {(await response.read())[:200]!r}"
                return result
            async for raw in response.content:  # one SSE line at a time
                line = raw.strip()
                if not line.startswith(b"data: ") or line == b"data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    result.error = chunk["error"]["message"]
                    return result
                now = time.perf_counter()
                if chunk.get("usage"):
                    result.output_tokens = chunk["usage"]["completion_tokens"]
                if chunk["choices"] and chunk["choices"][0]["text"]:
                    if result.ttft is None:
                        result.ttft = now - started
                    else:
                        result.itl.append(now - last)
                    last = now
        result.latency = time.perf_counter() - started
        result.ok = result.ttft is not None
    except Exception as exc:  # a failed request is counted, not fatal
        result.error = repr(exc)
    return result


async def run_rate(base_url: str, api_key: str, model: str, work, rate: float, seed: int) -> tuple[list, float]:
    """Like vLLM's benchmark_serving, the client is aiohttp (its C HTTP parser keeps the load
    generator's own CPU use small: it shares the machine with the stack)."""
    import aiohttp
    from tqdm.auto import tqdm

    rng = random.Random(seed)
    url = base_url.rstrip("/") + "/v1/completions"
    headers = {"Authorization": f"Bearer {api_key}"}
    bar = tqdm(total=len(work), desc=f"rate {rate:g} req/s", dynamic_ncols=True)
    connector = aiohttp.TCPConnector(limit=len(work) + 4)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=600)) as session:
        async def timed(prompt, n):
            result = await one_request(session, url, headers, model, prompt, n)
            bar.update(1)
            return result

        tasks = []
        started = time.perf_counter()
        for prompt, n in work:
            tasks.append(asyncio.create_task(timed(prompt, n)))
            if math.isfinite(rate):
                await asyncio.sleep(rng.expovariate(rate))  # Poisson arrivals
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - started
    bar.close()
    return results, duration


async def idle_ttft(base_url: str, api_key: str, model: str, prompts) -> list[float]:
    """TTFT of requests sent one at a time (the engine idle at each arrival): what the stack adds."""
    import aiohttp

    url = base_url.rstrip("/") + "/v1/completions"
    headers = {"Authorization": f"Bearer {api_key}"}
    ttfts = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        for prompt in prompts:
            result = await one_request(session, url, headers, model, prompt, PROBE_TOKENS)
            if result.ok:
                ttfts.append(result.ttft)
            await asyncio.sleep(0.05)
    return ttfts


def summarize(results: list[RequestResult], duration: float) -> dict:
    done = [r for r in results if r.ok]
    tokens = sum(r.output_tokens for r in done)
    tpot = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in done if r.output_tokens > 1]
    itl = [gap for r in done for gap in r.itl]

    def stats(values, scale=1000.0):
        if not values:
            return {"mean": float("nan"), "p50": float("nan"), "p99": float("nan")}
        ordered = sorted(values)
        pick = lambda q: ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))] * scale  # noqa: E731
        return {"mean": statistics.fmean(values) * scale, "p50": pick(0.5), "p99": pick(0.99)}

    return {"completed": len(done), "failed": len(results) - len(done), "duration_s": duration,
            "request_throughput": len(done) / duration, "output_tok_s": tokens / duration,
            "ttft_ms": stats([r.ttft for r in done]), "tpot_ms": stats(tpot), "itl_ms": stats(itl),
            "errors": sorted({r.error for r in results if r.error})[:5]}


def launch_stack(model_dir: str, work_dir: Path):
    from tests.platform.live_stack import LiveStack

    print(f"starting redis + engine worker + daphne on {model_dir} ...", flush=True)
    return LiveStack.start(model_dir, work_dir, engine_args=ENGINE_ARGS, env={"SERVED_MODEL_NAME": "bench"})


# ---------------------------------------------------------------- main

def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, nargs=2, default=(32, 256), metavar=("MIN", "MAX"))
    parser.add_argument("--output-len", type=int, nargs=2, default=(32, 256), metavar=("MIN", "MAX"))
    parser.add_argument("--rates", default="1,4,inf", help="comma-separated request rates (req/s); inf = burst")
    parser.add_argument("--model", help="HF folder (default: the 31M-param bench model, built once)")
    parser.add_argument("--base-url", help="benchmark a running server instead of launching one")
    parser.add_argument("--api-key")
    parser.add_argument("--model-name", default="bench")
    parser.add_argument("--skip-offline", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=str(BENCH_DIR / "serving.json"))
    return parser.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    model_dir = args.model or bench_model_dir()
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(model_dir).vocab_size
    work = random_workload(args.num_requests, tuple(args.prompt_len), tuple(args.output_len), args.seed, vocab)
    rates = [float(r) for r in args.rates.split(",")]
    report = {"machine": machine_line(), "workload": vars(args) | {"model": model_dir}, "rates": {}}
    probe_prompts = [p for p, _ in work[:PROBE_REQUESTS]]
    if not args.skip_offline:
        print("bare engine, offline, same workload ...", flush=True)
        report["offline"] = offline_baseline(model_dir, work, probe_prompts)
    stack = None
    try:
        if args.base_url:
            base_url, api_key, model_name = args.base_url, args.api_key, args.model_name
        else:
            stack = launch_stack(model_dir, Path(tempfile.mkdtemp(prefix="tessera-serving-")))
            base_url, api_key, model_name = stack.base_url, stack.api_key, stack.model_name
        asyncio.run(run_rate(base_url, api_key, model_name, work[:2], float("inf"), args.seed))  # warm-up
        for rate in rates:
            results, duration = asyncio.run(run_rate(base_url, api_key, model_name, work, rate, args.seed))
            report["rates"][str(rate)] = summarize(results, duration)
        # After the rates, like the bare probe after its runs: both engines have seen these shapes.
        time.sleep(2.0)  # let the stack finish settling the burst's usage first
        ttfts = asyncio.run(idle_ttft(base_url, api_key, model_name, probe_prompts))
        report["idle_ttft_ms"] = {"p50": statistics.median(ttfts) * 1000 if ttfts else float("nan"),
                                  "completed": len(ttfts)}
    finally:
        if stack is not None:
            stack.stop()
    report["tables"] = print_report(report)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    return report


def print_report(report: dict) -> str:
    rows = []
    for rate, s in report["rates"].items():
        rows.append([rate, s["completed"], s["failed"], s["request_throughput"], s["output_tok_s"],
                     s["ttft_ms"]["mean"], s["ttft_ms"]["p50"], s["ttft_ms"]["p99"],
                     s["tpot_ms"]["mean"], s["tpot_ms"]["p50"], s["tpot_ms"]["p99"],
                     s["itl_ms"]["mean"], s["itl_ms"]["p50"], s["itl_ms"]["p99"]])
    headers = ["rate req/s", "ok", "failed", "req/s", "out tok/s", "TTFT mean", "TTFT p50", "TTFT p99",
               "TPOT mean", "TPOT p50", "TPOT p99", "ITL mean", "ITL p50", "ITL p99"]
    tables = [print_table(f"Serving over HTTP ({report['machine']})", headers, rows)]
    offline = report.get("offline")
    if offline and report["rates"]:
        saturated = report["rates"][max(report["rates"], key=float)]
        ratio = saturated["output_tok_s"] / offline["output_tok_s"]
        added = report["idle_ttft_ms"]["p50"] - offline["idle_ttft_p50_ms"]
        report["comparison"] = {"served_vs_offline_tok_s": ratio, "added_p50_ttft_ms_idle": added}
        headers = ["bare out tok/s", "served out tok/s (highest rate)", "ratio", "bare idle TTFT p50 ms",
                   "served idle TTFT p50 ms", "added ms"]
        row = [offline["output_tok_s"], saturated["output_tok_s"], ratio, offline["idle_ttft_p50_ms"],
               report["idle_ttft_ms"]["p50"], added]
        tables.append(print_table("Served vs bare engine", headers, [row]))
    return "\n".join(tables)


if __name__ == "__main__":
    main()
