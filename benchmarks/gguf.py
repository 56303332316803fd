"""GGUF files in their three weight formats (issue 32): `make bench ARGS=gguf`.

For each file (the default SmolLM2-135M-Instruct Q4_1 file; Qwen2.5-Coder-0.5B-Instruct Q4_K_M when
../shared/models/qwen-coder.sh has assembled it, or QWEN_GGUF names it) and each `weights` format
(packed: the file's blocks and the C kernels; bfloat16 and float32: dequantized at load), a fresh process
loads the engine and reports its load time and resident set after load, then one request at batch 1 in
llama-bench's `-p 512 -n 128` style: prompt tok/s (a 512-token prompt's prefill) and decode tok/s (128
tokens after the first from a one-token prompt, greedy, ignore_eos; llama-bench's tg test also starts from
an empty context). Formats alternate within each repeat, so a busy machine slows every
format alike; the table gives the median over repeats. With LLAMA_BENCH naming llama.cpp's llama-bench
(bash ../shared/peers/llama-cpp.sh builds it), each repeat also runs `llama-bench -t 2 -p 512 -n 128` on the
same file, and its row gives the peak resident set of that process.

`make bench ARGS="gguf --models llama3-8b-shape --weights packed"` runs a random-weight file in Llama-3-8B's
shape, every matrix Q4_K (benchmarks/llama8b_shape.py writes it once, 4.5 GB, to ~/.cache/tessera-models):
what an 8B model's load takes in time and memory. It is not in the default --models, which would otherwise
write that file on any machine `make bench` runs on and hold about 7 GB at its load's peak, and it runs
packed only.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.common import machine_line, print_table, real_model_path

REPO = Path(__file__).resolve().parents[1]
QWEN_DIR = Path.home() / ".cache" / "tessera-models"
QWEN_FILES = {  # name: (label, file ../shared/models/qwen-coder.sh assembles, its argument)
    "qwen0.5b": ("Qwen2.5-Coder-0.5B Q4_K_M", "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf", "0.5b"),
    "qwen1.5b": ("Qwen2.5-Coder-1.5B Q4_K_M", "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf", "1.5b"),
}
LLAMA8B = ("llama3-8b-shape", "Llama-3-8B shape, random Q4_K")  # name, label (benchmarks/llama8b_shape.py)
# label -> why it runs in the packed format alone
PACKED_ONLY = {LLAMA8B[1]: "dequantized, its weights would take 16 GB (bfloat16) or 32 GB (float32)"}
LLAMA_CPP = "llama.cpp"
WEIGHTS = ("packed", "bfloat16", "float32")


def model_files(names: list[str]) -> dict[str, str]:
    """name -> GGUF path of the files asked for that are here; the others are skipped with how to get them."""
    files = {}
    for name in names:
        if name == "smollm2":
            files["SmolLM2-135M Q4_1"] = real_model_path()
        elif name == LLAMA8B[0]:
            from benchmarks import llama8b_shape

            path = llama8b_shape.ensure()
            print(f"{LLAMA8B[0]}: {path} ({path.stat().st_size / 1e9:.2f} GB)")
            files[LLAMA8B[1]] = str(path)
        elif name in QWEN_FILES:
            if path := qwen_file(name):
                files[QWEN_FILES[name][0]] = path
        else:
            raise ValueError(f"unknown model {name!r}; choose from smollm2, {', '.join(QWEN_FILES)}, {LLAMA8B[0]}")
    return files


def qwen_file(name: str) -> str | None:
    """The Qwen2.5-Coder GGUF ../shared/models/qwen-coder.sh assembles (QWEN_GGUF may name the 0.5B one),
    or None, having said how to get it."""
    _, file_name, size = QWEN_FILES[name]
    override = os.environ.get("QWEN_GGUF") if name == "qwen0.5b" else None
    path = Path(override or QWEN_DIR / file_name)
    if not path.exists():
        print(f"skipping {name}: no {path} (bash ../shared/models/qwen-coder.sh {size} assembles it)", flush=True)
        return None
    return str(path)


def resident_mib() -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def measure(model: str, weights: str, prompt_tokens: int, decode_tokens: int) -> dict:
    """In this process: load, then one request; the figures of one run."""
    from inference import LLM

    started = time.perf_counter()
    llm = LLM(
        model=model,
        device="cpu",
        weights=weights,
        max_model_len=prompt_tokens + decode_tokens + 16,
        max_num_seqs=4,
        max_num_batched_tokens=max(2048, prompt_tokens),
    )
    load_s = time.perf_counter() - started
    rss = resident_mib()
    engine = llm.llm_engine
    engine.warm_up()
    prompt = [1000 + (7919 * i) % 20000 for i in range(prompt_tokens)]  # ordinary tokens, no special ones
    prefill_s, _ = timed_request(engine, prompt, 1)
    # as llama-bench's tg test: the decode starts from an (almost) empty context, not after the prompt
    first_token_s, total_s = timed_request(engine, prompt[:1], decode_tokens + 1)
    engine.shutdown()
    return {
        "load_s": load_s,
        "rss_mib": rss,
        "prompt_tok_s": prompt_tokens / prefill_s,
        "decode_tok_s": decode_tokens / (total_s - first_token_s),
        "weights_dtype": engine.memory["weights_dtype"],
    }


def timed_request(engine, prompt: list[int], max_tokens: int) -> tuple[float, float]:
    """One greedy request alone: seconds to its first token and to its last."""
    from inference import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    engine.add_request(f"bench-{len(prompt)}", {"prompt_token_ids": prompt}, params)
    started = time.perf_counter()
    while not any(output.outputs[0].token_ids for output in engine.step()):
        pass
    first_token = time.perf_counter() - started
    while engine.has_unfinished_requests():
        engine.step()
    return first_token, time.perf_counter() - started


def run_child(model: str, weights: str, prompt_tokens: int, decode_tokens: int) -> dict:
    """measure() in a fresh process: load time and resident set are the load's alone."""
    command = [
        sys.executable,
        "-m",
        "benchmarks.gguf",
        "--child",
        model,
        weights,
        str(prompt_tokens),
        str(decode_tokens),
    ]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, check=False)
    if done.returncode:
        raise RuntimeError(f"{weights} run of {model} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def run_llama_bench(binary: str, model: str, prompt_tokens: int, decode_tokens: int) -> dict:
    """llama-bench on the same file and threads: its prompt and decode tok/s, and the process's peak RSS."""
    command = [binary, "-m", model, "-t", "2", "-p", str(prompt_tokens), "-n", str(decode_tokens), "-r", "1"]
    process = subprocess.Popen([*command, "-o", "json"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    stdout = process.stdout.read() if process.stdout else ""
    _, status, usage = os.wait4(process.pid, 0)
    if status:
        raise RuntimeError(f"{' '.join(command)} failed with status {status}")
    tests = json.loads(stdout)
    rate = {("prompt" if test["n_gen"] == 0 else "decode"): test["avg_ts"] for test in tests}
    return {
        "load_s": None,  # llama-bench does not report it
        "rss_mib": usage.ru_maxrss / 1024,  # KiB on Linux
        "prompt_tok_s": rate["prompt"],
        "decode_tok_s": rate["decode"],
        "weights_dtype": "the file's blocks",
    }


def formats(name: str, weights: list[str]) -> list[str]:
    """The formats a file runs in: for a PACKED_ONLY file, the packed one alone."""
    return [fmt for fmt in weights if name not in PACKED_ONLY or fmt == "packed"]


def table(files: dict[str, str], weights: list[str], prompt_tokens: int, decode_tokens: int, repeats: int) -> str:
    runs: dict[tuple[str, str], list[dict]] = {}
    for _ in range(repeats):
        for name, path in files.items():
            for fmt in formats(name, weights):  # alternating: each repeat runs every format once
                runs.setdefault((name, fmt), []).append(run_child(path, fmt, prompt_tokens, decode_tokens))
            if binary := os.environ.get("LLAMA_BENCH"):
                runs.setdefault((name, LLAMA_CPP), []).append(
                    run_llama_bench(binary, path, prompt_tokens, decode_tokens)
                )
    rows = []
    for (name, fmt), results in runs.items():

        def median(key: str) -> float | str:
            values = [r[key] for r in results if r[key] is not None]
            return statistics.median(values) if values else "-"

        rows.append(
            [
                name,
                fmt,
                results[0]["weights_dtype"],
                median("load_s"),
                median("rss_mib"),
                median("prompt_tok_s"),
                median("decode_tok_s"),
            ]
        )
    return print_table(
        f"GGUF weight formats, batch 1 (prompt {prompt_tokens}, decode {decode_tokens}), median of {repeats}, "
        f"{machine_line()}",
        [
            "model",
            "weights",
            "linear weights",
            "load s",
            "RSS after load MiB (llama.cpp: peak)",
            "prompt tok/s",
            "decode tok/s",
        ],
        rows,
    )


def main(argv=None) -> str:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="smollm2,qwen0.5b,qwen1.5b")
    parser.add_argument("--weights", default=",".join(WEIGHTS))
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--decode", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--child", nargs=4, metavar=("MODEL", "WEIGHTS", "PROMPT", "DECODE"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        model, weights, prompt, decode = args.child
        print(json.dumps(measure(model, weights, int(prompt), int(decode))), flush=True)
        return ""
    files = model_files(args.models.split(","))
    weights = args.weights.split(",")
    for name in files.keys() & PACKED_ONLY.keys():
        if skipped := [fmt for fmt in weights if fmt != "packed"]:
            print(f"skipping {name} in {', '.join(skipped)}: {PACKED_ONLY[name]}")
    return table(files, weights, args.prompt, args.decode, args.repeats)


if __name__ == "__main__":
    main()
