"""Weight formats and tensor parallelism on the CPU bench model.

1. Throughput and weight memory of fp32, bf16, int8 (quantized at load) and int4 (a GPTQ
   group-128 checkpoint written from the bench model by inference.quantization.export) on one rank.
2. TP=2 vs TP=1 (fp32, gloo on CPU): throughput, mean step time, and the per-step overhead of the
   split, i.e. the TP=2 step time minus half the TP=1 step time (the ideal if compute halved and
   the broadcasts and all-reduces were free). On a CPU the two ranks share the machine's cores, so
   this measures the machinery, not a speed-up; TP pays off when each rank has its own device.

The workload is smaller than the throughput benchmark's (default 64 requests, prompts 32..256,
outputs 16..64, greedy, ignore_eos): every configuration loads its own engine.
"""

from __future__ import annotations

import argparse

from benchmarks.common import BENCH_DIR, Timer, bench_model_dir, machine_line, print_table, random_workload
from inference import LLM, SamplingParams

FORMATS = {  # label -> (folder kind, engine arguments)
    "fp32": ("float", {"dtype": "float32"}),
    "bf16": ("float", {"dtype": "bfloat16"}),
    "int8": ("float", {"dtype": "float32", "quantization": "int8"}),
    "int4 (GPTQ g128)": ("gptq", {"dtype": "float32"}),
}


def gptq_bench_dir() -> str:
    from inference.quantization.export import write_quantized_folder

    folder = BENCH_DIR / "llama-31m-gptq-g128"
    if not (folder / "config.json").exists():
        write_quantized_folder(bench_model_dir("float32"), folder, "gptq", 128)
    return str(folder)


def run(model_dir: str, work, **engine_args) -> dict:
    """Warm up, then time the workload; counts engine steps for the per-step figures."""
    llm = LLM(model=model_dir, max_model_len=1024, max_num_seqs=256, max_num_batched_tokens=2048, **engine_args)
    engine = llm.llm_engine
    try:
        params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for _, n in work]
        llm.generate(prompt_token_ids=[work[0][0]], sampling_params=params[0], use_tqdm=False)
        steps = count_steps(engine)
        with Timer() as t:
            outs = llm.generate(prompt_token_ids=[p for p, _ in work], sampling_params=params, use_tqdm=False)
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        return {
            "tok_s": tokens / t.seconds,
            "step_ms": 1000 * t.seconds / max(steps[0], 1),
            "weights_mib": engine.memory["weights_bytes"] / 2**20,
            "weights_dtype": engine.memory["weights_dtype"],
        }
    finally:
        engine.shutdown()


def count_steps(engine) -> list[int]:
    """Wrap engine.step on this instance only; the list holds the running count."""
    counter, step = [0], engine.step

    def counted(*args, **kwargs):
        counter[0] += 1
        return step(*args, **kwargs)

    engine.step = counted
    return counter


def format_table(work, label: str) -> str:
    rows = []
    for name, (kind, engine_args) in FORMATS.items():
        folder = gptq_bench_dir() if kind == "gptq" else bench_model_dir("float32")
        r = run(folder, work, **engine_args)
        rows.append([name, r["weights_dtype"], r["weights_mib"], r["tok_s"], r["step_ms"]])
    return print_table(
        f"Weight formats, {label}, {machine_line()}",
        ["format", "linear weights", "weights MiB", "tok/s", "ms/step"],
        rows,
    )


def tp_table(work, label: str) -> str:
    one = run(bench_model_dir("float32"), work, dtype="float32")
    two = run(bench_model_dir("float32"), work, dtype="float32", tensor_parallel_size=2)
    overhead = two["step_ms"] - one["step_ms"] / 2
    rows = [
        ["1", one["weights_mib"], one["tok_s"], one["step_ms"], "-"],
        ["2 (gloo)", two["weights_mib"], two["tok_s"], two["step_ms"], overhead],
    ]
    return print_table(
        f"Tensor parallelism on CPU, fp32, {label}, {machine_line()}",
        ["tensor_parallel_size", "weights MiB per rank", "tok/s", "ms/step", "overhead ms/step vs ideal halving"],
        rows,
    )


def main(argv=None) -> str:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--prompt", default="32,256", help="prompt length range, min,max")
    parser.add_argument("--output", default="16,64", help="output length range, min,max")
    parser.add_argument("--sections", default="formats,tp")
    args = parser.parse_args(argv)
    prompt = tuple(int(v) for v in args.prompt.split(","))
    output = tuple(int(v) for v in args.output.split(","))
    work = random_workload(args.requests, prompt, output, seed=0)
    label = (
        f"{args.requests} requests (prompts {prompt[0]}..{prompt[1]}, outputs {output[0]}..{output[1]}; "
        "smaller than the throughput benchmark)"
    )
    tables = []
    if "formats" in args.sections:
        tables.append(format_table(work, label))
    if "tp" in args.sections:
        tables.append(tp_table(work, label))
    return "\n".join(tables)


if __name__ == "__main__":
    main()
