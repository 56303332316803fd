"""Offline throughput: our engine vs HF transformers on the same model, dtype and workload.

Workload (issue 2): 256 requests, prompts uniform 32..512 random token ids, outputs uniform
32..256 with ignore_eos, greedy. Baselines: HF `generate` one request at a time (the first
--hf-single requests) and HF `generate` in static batches of 16 with left padding (the first
--hf-batched requests; each batch runs to its longest output, only requested tokens count).
Models (--models): the 31M random-weight Llama and the real SmolLM2-135M-Instruct, whose 30
layers and 49k-token LM head cost differently from the toy's.
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.common import BENCH_MODELS, Timer, bench_model, hf_model, machine_line, print_table, random_workload
from inference import LLM, SamplingParams


def run_engine(model_dir: str, dtype: str, work) -> dict:
    llm = LLM(model=model_dir, dtype=dtype, max_model_len=1024, max_num_seqs=256, max_num_batched_tokens=2048)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for _, n in work]
    llm.generate(prompt_token_ids=[work[0][0]], sampling_params=params[0], use_tqdm=False)  # warm-up
    llm.llm_engine.metrics.peak_allocated_slots = 0
    with Timer() as t:
        outs = llm.generate(prompt_token_ids=[p for p, _ in work], sampling_params=params)
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"tokens": tokens, "seconds": t.seconds, "kv_fill": llm.llm_engine.metrics.kv_fill_at_peak}


@torch.inference_mode()
def run_hf_single(model, work) -> dict:
    tokens = 0
    with Timer() as t:
        for prompt, n in work:
            out = model.generate(
                torch.tensor([prompt]),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                max_new_tokens=n,
                do_sample=False,
                pad_token_id=0,
            )
            tokens += out.shape[1] - len(prompt)
    return {"tokens": tokens, "seconds": t.seconds}


@torch.inference_mode()
def run_hf_static(model, work, batch_size: int = 16) -> dict:
    tokens = 0
    with Timer() as t:
        for i in range(0, len(work), batch_size):
            batch = work[i : i + batch_size]
            width = max(len(p) for p, _ in batch)
            ids = torch.zeros(len(batch), width, dtype=torch.long)
            mask = torch.zeros(len(batch), width, dtype=torch.long)
            for row, (prompt, _) in enumerate(batch):  # left padding
                ids[row, width - len(prompt) :] = torch.tensor(prompt)
                mask[row, width - len(prompt) :] = 1
            model.generate(
                ids, attention_mask=mask, max_new_tokens=max(n for _, n in batch), do_sample=False, pad_token_id=0
            )
            tokens += sum(n for _, n in batch)  # only the tokens each request asked for count
    return {"tokens": tokens, "seconds": t.seconds}


def main(argv=None) -> str:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default=",".join(BENCH_MODELS), help=f"of {', '.join(BENCH_MODELS)}")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--hf-single", type=int, default=32, help="requests timed for HF one at a time")
    parser.add_argument("--hf-batched", type=int, default=64, help="requests timed for HF static batches")
    parser.add_argument("--prompt-range", default="32,512", help="min,max prompt tokens")
    parser.add_argument("--output-range", default="32,256", help="min,max output tokens")
    args = parser.parse_args(argv)
    prompts, outputs = (tuple(int(x) for x in r.split(",")) for r in (args.prompt_range, args.output_range))
    work = random_workload(args.requests, prompts, outputs, seed=0)
    rows = []
    for name in args.models.split(","):
        path = bench_model(name)
        for dtype in args.dtypes.split(","):
            rows.append([BENCH_MODELS[name], *measure(path, dtype, work, args)])
    return print_table(
        f"Offline throughput, {args.requests} requests (prompts {prompts[0]}..{prompts[1]}, outputs "
        f"{outputs[0]}..{outputs[1]}), {machine_line()}",
        [
            "model",
            "dtype",
            "engine tok/s",
            "HF one-at-a-time tok/s",
            "HF static batch 16 tok/s",
            "vs one-at-a-time",
            "vs static batches",
            "KV slots holding real tokens at peak",
        ],
        rows,
    )


def measure(path: str, dtype: str, work, args) -> list:
    engine = run_engine(path, dtype, work)
    model = hf_model(path, dtype)
    single = run_hf_single(model, work[: args.hf_single])
    static = run_hf_static(model, work[: args.hf_batched])
    del model
    tps = {name: r["tokens"] / r["seconds"] for name, r in (("engine", engine), ("single", single), ("static", static))}
    return [
        dtype,
        tps["engine"],
        tps["single"],
        tps["static"],
        tps["engine"] / tps["single"],
        tps["engine"] / tps["static"],
        f"{engine['kv_fill'] * 100:.1f}%",
    ]


if __name__ == "__main__":
    main()
