"""Where one decode step's time goes, at batch 1, 16 and 256: `make bench ARGS=profile`.

The engine's own phases are timed by wrapping them (schedule, prepare inputs, the forward pass,
sampling, detokenization, the scheduler's update, building outputs), then torch.profiler names the
operators inside the forward. Every request is decoding when the timed steps run (prefill first),
so a row is a pure decode step of that batch size. What to change comes from this table, not from
guesses (issue 20: "profile before changing anything").
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict

import torch

from benchmarks.common import bench_model, machine_line, print_table, random_workload
from inference import LLM, SamplingParams

PHASES = ["schedule", "prepare", "forward", "sample", "detokenize", "update", "outputs"]


def timed(fn, name: str, spent: dict):
    def run(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            spent[name] += time.perf_counter() - start

    return run


def instrument(engine, spent: dict) -> None:
    """Wrap each phase where the engine calls it (instance attributes shadow the methods)."""
    engine.scheduler.schedule = timed(engine.scheduler.schedule, "schedule", spent)
    engine.runner.prepare = timed(engine.runner.prepare, "prepare", spent)
    engine.executor.execute = timed(engine.executor.execute, "forward", spent)
    engine.sampler = timed(engine.sampler, "sample", spent)
    engine._detokenize = timed(engine._detokenize, "detokenize", spent)
    engine.scheduler.update_from_output = timed(engine.scheduler.update_from_output, "update", spent)
    engine._output = timed(engine._output, "outputs", spent)


def decoding_engine(model: str, dtype: str, batch: int, steps: int):
    """An engine with `batch` requests, all past their prefill, each with room for `steps` more tokens."""
    llm = LLM(model=model, dtype=dtype, max_model_len=1024, max_num_seqs=max(batch, 1), seed=0)
    engine = llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=4 * steps + 16, ignore_eos=True)
    vocab = engine.model_config.vocab_size
    for i, (prompt, _) in enumerate(random_workload(batch, (128, 128), (1, 1), seed=batch, vocab=vocab)):
        engine.add_request(f"profile-{i}", {"prompt_token_ids": prompt}, params)
    while engine.scheduler.waiting or any(r.num_output_tokens == 0 for r in engine.scheduler.running):
        engine.step()
    for _ in range(3):  # warm caches and allocator
        engine.step()
    return llm, engine


def profile_batch(model: str, dtype: str, batch: int, steps: int) -> tuple[list, str]:
    llm, engine = decoding_engine(model, dtype, batch, steps)
    spent: dict[str, float] = defaultdict(float)
    instrument(engine, spent)
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    step_ms = (time.perf_counter() - start) * 1000 / steps
    row = [batch, f"{step_ms:.2f}", f"{batch * 1000 / step_ms:,.0f}"]
    row += [f"{spent[name] * 1000 / steps:.2f}" for name in PHASES]
    row.append(f"{step_ms - sum(spent.values()) * 1000 / steps:.2f}")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(min(steps, 5)):
            engine.step()
    ops = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=8)
    del llm, engine
    return row, ops


def main(argv=None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="random-31m", help="random-31m or smollm2-135m")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--batches", default="1,16,256")
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args(argv)
    model = bench_model(args.model)
    rows, op_tables = [], []
    for batch in (int(b) for b in args.batches.split(",")):
        row, ops = profile_batch(model, args.dtype, batch, args.steps)
        rows.append(row)
        op_tables.append(f"batch {batch}, the forward's operators (torch.profiler, {min(args.steps, 5)} steps):\n{ops}")
        print(f"batch {batch}: {row[1]} ms per step", flush=True)
    header = ["batch", "step ms", "tok/s", *[f"{p} ms" for p in PHASES], "other ms"]
    title = f"One decode step, {args.model} {args.dtype}, mean of {args.steps} steps ({machine_line()})"
    table = print_table(title, header, rows)
    for ops in op_tables:
        print(ops)
    return table


if __name__ == "__main__":
    main()
