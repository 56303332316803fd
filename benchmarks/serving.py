"""Serving benchmark in the method of vLLM's benchmark_serving: Poisson arrivals through the HTTP API.

For each request rate (requests/s; "inf" sends everything at once) the same workload is sent as
streaming /v1/completions requests with Poisson (exponential inter-arrival) timing. Reported:
request throughput, output tokens/s, TTFT, TPOT (time per output token after the first) and ITL
(gaps between streamed chunks), mean / p50 / p99. The bare engine runs the same workload
offline (LLM.generate) in this process, alternating with the served saturated runs, so the table
shows what the web tier + Redis + worker cost:
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
import os
import random
import resource
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO_DIR = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO_DIR), str(REPO_DIR / "platform")]

from benchmarks.common import BENCH_DIR, bench_model_dir, machine_line, print_table, random_workload  # noqa: E402
from tessera.run import WEB_SERVERS  # noqa: E402

# Complete on purpose: the live stack's own test defaults (a 128-block pool) must not leak in, or
# the served engine would queue and preempt where the bare one does not. Prefix caching is off:
# every rate replays the same prompts, and cache hits from the previous rate would flatter the next.
# The device is the engine's default (CUDA when there is one), for the bare and the served engine alike.
ENGINE_ARGS = {
    "dtype": "float32",
    "device": "auto",
    "block_size": 16,
    "max_model_len": 1024,
    "max_num_seqs": 64,
    "max_num_batched_tokens": 2048,
    "num_kv_blocks": None,
    "enable_prefix_caching": False,
    "seed": 0,
}


PROBE_REQUESTS = 16  # idle-TTFT probe: this many prompts of the workload, one at a time
PROBE_TOKENS = 4
# Both sides of the served-vs-bare ratio are the median of this many runs: on 2 cores one run of
# the saturated rate varies by about +-5% from the next.
SATURATED_RUNS = 3


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


class BareEngine:
    """The same workload offline (LLM.generate) in this process: the no-stack reference.

    Its saturated runs alternate with the served ones (see measure_rates), so drift in the
    machine's speed over the benchmark hits both sides of the ratio alike. A warm-up run comes
    first: the served engine has run the workload too (at the lower rates) before its saturated
    rate, so both have built their oneDNN GEMM primitives.
    """

    def __init__(self, model_dir: str, work):
        from inference import LLM, SamplingParams

        self.llm = LLM(model=model_dir, **ENGINE_ARGS)
        self.prompts = [p for p, _ in work]
        self.params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for _, n in work]
        self.llm.generate(prompt_token_ids=self.prompts, sampling_params=self.params, use_tqdm=False)

    def run(self) -> float:
        """Output tokens/s of one run; its CPU time per output token goes to self.cpu_us_per_token."""
        cpu_before, started = own_cpu_s(), time.perf_counter()
        outs = self.llm.generate(prompt_token_ids=self.prompts, sampling_params=self.params, use_tqdm=False)
        elapsed = time.perf_counter() - started
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        self.cpu_us_per_token = (own_cpu_s() - cpu_before) / tokens * 1e6
        return tokens / elapsed

    def idle_ttft_p50_ms(self, prompts) -> float:
        return statistics.median(self._ttft(p) for p in prompts) * 1000

    def _ttft(self, prompt) -> float:
        from inference import SamplingParams

        engine = self.llm.llm_engine
        started = time.perf_counter()
        engine.add_request(
            "ttft-probe",
            {"prompt_token_ids": prompt},
            SamplingParams(temperature=0.0, max_tokens=PROBE_TOKENS, ignore_eos=True),
        )
        first = None
        while engine.has_unfinished_requests():
            for out in engine.step():
                if first is None and out.outputs and out.outputs[0].token_ids:
                    first = time.perf_counter() - started
        return first or 0.0


# ---------------------------------------------------------------- CPU time per process


def own_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def process_cpu_s(pid: int) -> float | None:
    """User + system CPU seconds of a process so far (Linux /proc; None elsewhere or once it is gone)."""
    if pid == os.getpid():
        return own_cpu_s()
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cpu_us_per_token(before: dict, after: dict, tokens: int) -> dict:
    """CPU microseconds each process spent per output token between two process_cpu_s snapshots."""
    return {
        name: (after[name] - before[name]) / tokens * 1e6
        for name in before
        if before[name] is not None and after.get(name) is not None and tokens
    }


# ---------------------------------------------------------------- the served stack


async def one_request(session, url: str, headers: dict, model: str, prompt, max_tokens: int) -> RequestResult:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    result = RequestResult(ok=False, prompt_len=len(prompt))
    started = last = time.perf_counter()
    try:
        async with session.post(url, json=body, headers=headers) as response:
            if response.status != 200:
                result.error = f"HTTP {response.status}: {(await response.read())[:200]!r}"
                return result
            async for raw in response.content:  # one SSE line at a time
                line = raw.strip()
                if line == b"data: [DONE]":
                    result.ok = True
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
        if not result.ok:
            result.error = "the stream ended without data: [DONE]"
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
            if result.ok and result.ttft is not None:
                ttfts.append(result.ttft)
            await asyncio.sleep(0.05)
    return ttfts


def summarize(results: list[RequestResult], duration: float) -> dict:
    done = [r for r in results if r.ok]
    tokens = sum(r.output_tokens for r in done)
    # A random-weight model may emit only tokens that decode to no text: such a stream counts
    # (tokens, latency) but has no time to first text.
    timed = [r for r in done if r.ttft is not None]
    tpot = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in timed if r.output_tokens > 1]
    itl = [gap for r in done for gap in r.itl]

    def stats(values, scale=1000.0):
        if not values:
            return {"mean": float("nan"), "p50": float("nan"), "p99": float("nan")}
        ordered = sorted(values)
        pick = lambda q: ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))] * scale  # noqa: E731
        return {"mean": statistics.fmean(values) * scale, "p50": pick(0.5), "p99": pick(0.99)}

    return {
        "completed": len(done),
        "failed": len(results) - len(done),
        "duration_s": duration,
        "request_throughput": len(done) / duration,
        "output_tokens": tokens,
        "output_tok_s": tokens / duration,
        "ttft_ms": stats([r.ttft for r in timed]),
        "tpot_ms": stats(tpot),
        "itl_ms": stats(itl),
        "errors": sorted({r.error for r in results if r.error})[:5],
    }


def launch_stack(
    model_dir: str,
    work_dir: Path,
    stream_interval: int = 1,
    web_server: str = WEB_SERVERS[0],
    engine_args: dict | None = None,
):
    from tests.platform.live_stack import LiveStack

    print(f"starting redis + engine worker + {web_server} on {model_dir} ...", flush=True)
    # The worker's production heartbeat (the live stack's test defaults beat 4x a second).
    env = {
        "SERVED_MODEL_NAME": "bench",
        "ENGINE_HEARTBEAT_INTERVAL": "1",
        "ENGINE_HEARTBEAT_TTL": "5",
        "ENGINE_STREAM_INTERVAL": str(stream_interval),
    }
    return LiveStack.start(model_dir, work_dir, engine_args=engine_args or ENGINE_ARGS, env=env, web_server=web_server)


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
    parser.add_argument(
        "--stream-interval",
        type=int,
        default=1,
        help="the launched worker's ENGINE_STREAM_INTERVAL (tokens per delta; 1 = every token)",
    )
    parser.add_argument(
        "--grouped-interval",
        type=int,
        default=8,
        help="then the highest rate once more on a stack streaming this many tokens per delta "
        "(0 = skip; not with --base-url)",
    )
    parser.add_argument("--web-server", default=WEB_SERVERS[0], choices=WEB_SERVERS, help="the launched stack's")
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
    bare = None
    if not args.skip_offline:
        print("bare engine, offline, same workload ...", flush=True)
        bare = BareEngine(model_dir, work)
    stack = None
    try:
        if args.base_url:
            base_url, api_key, model_name = args.base_url, args.api_key, args.model_name
        else:
            stack = launch_stack(
                model_dir, Path(tempfile.mkdtemp(prefix="tessera-serving-")), args.stream_interval, args.web_server
            )
            base_url, api_key, model_name = stack.base_url, stack.api_key, stack.model_name
        report["rates"] = measure_rates(base_url, api_key, model_name, work, rates, args.seed, bare, stack_pids(stack))
        # After the rates (the bare probe, too, runs after its saturated runs): both engines know these shapes.
        time.sleep(2.0)  # let the stack finish settling the burst's usage first
        ttfts = asyncio.run(idle_ttft(base_url, api_key, model_name, probe_prompts))
        report["idle_ttft_ms"] = {
            "p50": statistics.median(ttfts) * 1000 if ttfts else float("nan"),
            "completed": len(ttfts),
        }
    finally:
        if stack is not None:
            stack.stop()
    if args.grouped_interval > 1 and not args.base_url:
        print(f"the highest rate again, {args.grouped_interval} tokens per streamed delta ...", flush=True)
        report["grouped"] = grouped_saturation(model_dir, work, max(rates), args.grouped_interval, args.seed, bare)
    if bare is not None:
        report["offline"] = {"idle_ttft_p50_ms": bare.idle_ttft_p50_ms(probe_prompts)}
    report["tables"] = print_report(report)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    return report


def stack_pids(stack) -> dict[str, int]:
    """The processes whose CPU the saturated runs account for: the launched stack's and this client's."""
    if stack is None:
        return {}
    return {**{name: proc.pid for name, proc in stack.processes.items()}, "benchmark client": os.getpid()}


def measure_rates(
    base_url: str,
    api_key: str,
    model: str,
    work,
    rates: list[float],
    seed: int,
    bare: BareEngine | None = None,
    pids: dict[str, int] | None = None,
) -> dict:
    """Each rate once, the highest SATURATED_RUNS times (its median run is the one reported), each
    of those right after a bare-engine run. With pids, the median saturated run also reports each
    process's CPU time per output token ("cpu_us_per_token"; the bare engine's from the run before it)."""
    asyncio.run(run_rate(base_url, api_key, model, work[:2], float("inf"), seed))  # warm-up
    measured = {}
    for rate in rates:
        runs, bare_runs = [], []
        for _ in range(SATURATED_RUNS if rate == max(rates) else 1):
            bare_cpu = {}
            if bare is not None and rate == max(rates):
                bare_runs.append(bare.run())
                bare_cpu = {"bare engine": bare.cpu_us_per_token}
            before = {name: process_cpu_s(pid) for name, pid in (pids or {}).items()}
            summary = summarize(*asyncio.run(run_rate(base_url, api_key, model, work, rate, seed)))
            after = {name: process_cpu_s(pid) for name, pid in (pids or {}).items()}
            cpu = bare_cpu | cpu_us_per_token(before, after, summary["output_tokens"])
            runs.append(summary | {"cpu_us_per_token": cpu})
        median_run = sorted(runs, key=lambda s: s["output_tok_s"])[len(runs) // 2]
        measured[str(rate)] = median_run | {
            "runs_tok_s": [s["output_tok_s"] for s in runs],
            "bare_runs_tok_s": bare_runs,
        }
    return measured


def grouped_saturation(model_dir: str, work, rate: float, interval: int, seed: int, bare: BareEngine | None) -> dict:
    """The saturated rate on a fresh stack whose worker streams `interval` tokens per delta."""
    stack = launch_stack(model_dir, Path(tempfile.mkdtemp(prefix="tessera-serving-")), interval)
    try:
        return measure_rates(
            stack.base_url, stack.api_key, stack.model_name, work, [rate], seed, bare, stack_pids(stack)
        )[str(rate)] | {"stream_interval": interval}
    finally:
        stack.stop()


def print_report(report: dict) -> str:
    rows = []
    for rate, s in report["rates"].items():
        rows.append(
            [
                rate,
                s["completed"],
                s["failed"],
                s["request_throughput"],
                s["output_tok_s"],
                s["ttft_ms"]["mean"],
                s["ttft_ms"]["p50"],
                s["ttft_ms"]["p99"],
                s["tpot_ms"]["mean"],
                s["tpot_ms"]["p50"],
                s["tpot_ms"]["p99"],
                s["itl_ms"]["mean"],
                s["itl_ms"]["p50"],
                s["itl_ms"]["p99"],
            ]
        )
    headers = [
        "rate req/s",
        "ok",
        "failed",
        "req/s",
        "out tok/s",
        "TTFT mean",
        "TTFT p50",
        "TTFT p99",
        "TPOT mean",
        "TPOT p50",
        "TPOT p99",
        "ITL mean",
        "ITL p50",
        "ITL p99",
    ]
    interval = report["workload"].get("stream_interval", 1)
    grouping = f", {interval} tokens per streamed delta" if interval > 1 else ""
    tables = [print_table(f"Serving over HTTP ({report['machine']}{grouping})", headers, rows)]
    offline = report.get("offline")
    if offline and report["rates"]:
        tables.append(print_comparison(report, offline, interval))
    if report["rates"]:
        tables.append(print_cpu(report, interval))
    return "\n".join(tables)


CPU_COLUMNS = ["bare engine", "engine0", "web", "redis", "benchmark client"]


def print_cpu(report: dict, interval: int) -> str:
    """CPU time per output token of each process in the median saturated run. Where the engine's
    threads fill every core, another process's CPU time delays the engine's steps about 1:1."""
    rows = []
    for measured in highest_rate_runs(report, interval):
        cpu = measured.get("cpu_us_per_token") or {}
        served = [cpu[name] for name in CPU_COLUMNS[1:] if name in cpu]
        if not served:
            continue
        total = sum(served)
        extra = total - cpu["bare engine"] if "bare engine" in cpu else "-"
        rows.append([measured["stream_interval"], *[cpu.get(name, "-") for name in CPU_COLUMNS], total, extra])
    headers = ["tokens per delta", *[f"{name} us" for name in CPU_COLUMNS], "served total us", "served - bare us"]
    return print_table("CPU time per output token, highest rate (median run)", headers, rows) if rows else ""


def highest_rate_runs(report: dict, interval: int) -> list[dict]:
    """The highest rate's median run at the benchmark's stream interval, then the grouped one if measured."""
    saturated = report["rates"][max(report["rates"], key=float)] | {"stream_interval": interval}
    return [saturated] + ([report["grouped"]] if report.get("grouped") else [])


def print_comparison(report: dict, offline: dict, interval: int) -> str:
    """Served vs bare at the highest rate (and again with grouped deltas, when measured); each
    ratio is of medians over runs that alternated bare, served, bare, served..."""
    added = report["idle_ttft_ms"]["p50"] - offline["idle_ttft_p50_ms"]
    runs = lambda values: " / ".join(f"{v:,.0f}" for v in values)  # noqa: E731
    headers = [
        "tokens per delta",
        f"bare out tok/s (median of {SATURATED_RUNS})",
        "served out tok/s (highest rate, median)",
        "ratio",
        "bare runs",
        "served runs",
        "ITL p50 ms",
        "bare idle TTFT p50 ms",
        "served idle TTFT p50 ms",
        "added ms",
    ]
    rows, ratios = [], {}
    idle_ttft_cells = [offline["idle_ttft_p50_ms"], report["idle_ttft_ms"]["p50"], added]
    for measured, ttft_cells in zip(highest_rate_runs(report, interval), [idle_ttft_cells, ["-", "-", "-"]]):
        if not measured["bare_runs_tok_s"]:
            continue
        bare_tok_s = statistics.median(measured["bare_runs_tok_s"])
        ratios[measured["stream_interval"]] = measured["output_tok_s"] / bare_tok_s
        rows.append(
            [
                measured["stream_interval"],
                bare_tok_s,
                measured["output_tok_s"],
                ratios[measured["stream_interval"]],
                runs(measured["bare_runs_tok_s"]),
                runs(measured["runs_tok_s"]),
                measured["itl_ms"]["p50"],
                *ttft_cells,
            ]
        )
    report["comparison"] = {
        "served_vs_offline_tok_s": ratios.get(interval),
        "added_p50_ttft_ms_idle": added,
        "by_stream_interval": ratios,
    }
    return print_table("Served vs bare engine", headers, rows)


if __name__ == "__main__":
    main()
