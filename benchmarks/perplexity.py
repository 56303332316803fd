"""Perplexity of a GGUF file's weight formats on held-out text (issue 32): `make bench ARGS=perplexity`.

The packed kernels are not bit-equal to the float32 path (activations go through int8, prefill through
bfloat16), so their numerics are shown on text instead: Python's own documentation (pydoc_data's
topics, which ship with every Python) cut into windows of --context tokens, scored as llama.cpp's
llama-perplexity scores them: each window starts with BOS when the model adds one, and only the tokens
of its second half are predicted (each with at least half a window of context). Perplexity =
exp(mean negative log-likelihood).
With LLAMA_PERPLEXITY naming llama.cpp's llama-perplexity (build the `llama-perplexity` target in the tree
../shared/peers/llama-cpp.sh makes), the same file, text, window and windows are scored by it too.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import subprocess
import tempfile

from benchmarks.common import machine_line, print_table, real_model_path


def held_out_text() -> str:
    """pydoc_data's topics in a fixed order: English prose about Python, with code."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[name] for name in sorted(topics))


def windows(token_ids: list[int], context: int, count: int, bos: int | None) -> list[list[int]]:
    """The first `count` whole windows of `context` tokens, each starting with BOS when the model has one."""
    chunks = [token_ids[i * context : (i + 1) * context] for i in range(min(count, len(token_ids) // context))]
    return [[bos, *chunk[1:]] if bos is not None else chunk for chunk in chunks]


def bos_it_adds(tokenizer) -> int | None:
    """The BOS token when the tokenizer starts a text with one (the GGUF file's add_bos_token), as llama.cpp
    starts each window; None for models such as Qwen2.5 that have a BOS token but never add it."""
    first = tokenizer("x")["input_ids"][:1]
    return tokenizer.bos_token_id if first == [tokenizer.bos_token_id] else None


def window_nll(prompt_logprobs, token_ids: list[int]) -> tuple[float, int]:
    """Negative log-likelihood summed over the window's second half, and how many tokens that is."""
    first = len(token_ids) // 2
    scored = range(first + 1, len(token_ids))
    return -sum(prompt_logprobs[i][token_ids[i]].logprob for i in scored), len(scored)


def perplexity(model: str, weights: str, context: int, count: int) -> dict:
    from inference import LLM, SamplingParams

    llm = LLM(model=model, device="cpu", weights=weights, max_model_len=context + 8, enable_prefix_caching=False)
    tokenizer = llm.get_tokenizer()
    token_ids = tokenizer(held_out_text(), add_special_tokens=False)["input_ids"]
    prompts = windows(token_ids, context, count, bos_it_adds(tokenizer))
    params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0.0)
    outputs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    total, scored = 0.0, 0
    for output, prompt in zip(outputs, prompts):
        nll, n = window_nll(output.prompt_logprobs, prompt)
        total, scored = total + nll, scored + n
    llm.llm_engine.shutdown()
    return {"ppl": math.exp(total / scored), "windows": len(prompts), "tokens": scored}


def llama_perplexity(binary: str, model: str, context: int, count: int) -> dict:
    with tempfile.NamedTemporaryFile("w", suffix=".txt") as text:
        text.write(held_out_text())
        text.flush()
        command = [binary, "-m", model, "-f", text.name, "-c", str(context), "-b", str(context)]
        done = subprocess.run(
            [*command, "--chunks", str(count), "-t", "2"], capture_output=True, text=True, check=False
        )
    found = re.search(r"Final estimate: PPL = ([0-9.]+)", done.stdout + done.stderr)
    if done.returncode or not found:
        raise RuntimeError(f"{' '.join(command)} failed:\n{(done.stdout + done.stderr)[-2000:]}")
    return {"ppl": float(found.group(1)), "windows": count, "tokens": count * (context // 2 - 1)}


def main(argv=None) -> str:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="", help="GGUF files, comma-separated (default: make run's SmolLM2)")
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--windows", type=int, default=8)
    args = parser.parse_args(argv)
    rows = []
    for model in args.models.split(",") if args.models else [real_model_path()]:
        results = {weights: perplexity(model, weights, args.context, args.windows) for weights in ("float32", "packed")}
        if binary := os.environ.get("LLAMA_PERPLEXITY"):
            results["llama.cpp"] = llama_perplexity(binary, model, args.context, args.windows)
        reference = results["float32"]["ppl"]
        for name, result in results.items():
            rows.append(
                [
                    os.path.basename(model),
                    name,
                    result["windows"],
                    result["tokens"],
                    result["ppl"],
                    result["ppl"] / reference,
                ]
            )
    return print_table(
        f"Perplexity on pydoc_data's topics, windows of {args.context} tokens (second halves scored), {machine_line()}",
        ["file", "weights", "windows", "tokens scored", "perplexity", "/ float32"],
        rows,
    )


if __name__ == "__main__":
    main()
