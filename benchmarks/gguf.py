"""GGUF files in their three weight formats (issue 32): `make bench ARGS=gguf`.

For each file (the default SmolLM2-135M-Instruct Q4_1 file; Qwen2.5-Coder-0.5B-Instruct Q4_K_M when
../shared/models/qwen-coder.sh has assembled it, or QWEN_GGUF names it) and each `weights` format
(packed: the file's blocks and the C kernels; bfloat16 and float32: dequantized at load), a fresh process
loads the engine and reports its load time and resident set after load, then one request at batch 1 in
llama-bench's `-p 512 -n 128` style: prompt tok/s (a 512-token prompt's prefill) and decode tok/s (the
next 128 tokens, greedy, ignore_eos). Formats alternate within each repeat, so a busy machine slows every
format alike; the table gives the median over repeats.
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
QWEN_FILE = Path.home() / ".cache" / "tessera-models" / "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
WEIGHTS = ("packed", "bfloat16", "float32")


def model_files(names: list[str]) -> dict[str, str]:
    """name -> GGUF path of the files asked for that are here; the others are skipped with how to get them."""
    files = {}
    for name in names:
        if name == "smollm2":
            files["SmolLM2-135M Q4_1"] = real_model_path()
        elif name == "qwen0.5b":
            path = Path(os.environ.get("QWEN_GGUF") or QWEN_FILE)
            if path.exists():
                files["Qwen2.5-Coder-0.5B Q4_K_M"] = str(path)
            else:
                print(f"skipping qwen0.5b: no {path} (bash ../shared/models/qwen-coder.sh 0.5b assembles it)")
        else:
            raise ValueError(f"unknown model {name!r}; choose from smollm2, qwen0.5b")
    return files


def resident_mib() -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def measure(model: str, weights: str, prompt_tokens: int, decode_tokens: int) -> dict:
    """In this process: load, then one request; the figures of one run."""
    from inference import LLM, SamplingParams

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
    engine.add_request(
        "bench",
        {"prompt_token_ids": prompt},
        SamplingParams(temperature=0.0, max_tokens=decode_tokens, ignore_eos=True),
    )
    started = time.perf_counter()
    while not any(output.outputs[0].token_ids for output in engine.step()):
        pass
    first_token = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
    done = time.perf_counter()
    engine.shutdown()
    return {
        "load_s": load_s,
        "rss_mib": rss,
        "prompt_tok_s": prompt_tokens / (first_token - started),
        "decode_tok_s": (decode_tokens - 1) / (done - first_token),
        "weights_dtype": engine.memory["weights_dtype"],
    }


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


def table(files: dict[str, str], weights: list[str], prompt_tokens: int, decode_tokens: int, repeats: int) -> str:
    runs: dict[tuple[str, str], list[dict]] = {}
    for _ in range(repeats):
        for name, path in files.items():
            for fmt in weights:  # alternating: each repeat runs every format once
                runs.setdefault((name, fmt), []).append(run_child(path, fmt, prompt_tokens, decode_tokens))
    rows = []
    for (name, fmt), results in runs.items():

        def median(key: str) -> float:
            return statistics.median(r[key] for r in results)

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
        ["model", "weights", "linear weights", "load s", "RSS after load MiB", "prompt tok/s", "decode tok/s"],
        rows,
    )


def main(argv=None) -> str:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="smollm2,qwen0.5b")
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
    return table(files, args.weights.split(","), args.prompt, args.decode, args.repeats)


if __name__ == "__main__":
    main()
