"""Structured outputs: what the grammar mask costs per engine step (`make bench ARGS=grammar`).

The engine's own pieces (inference/structured_output.py) with the real model's tokenizer
(SmolLM2, 49,152 tokens): every row of a batch follows a JSON schema; per step the masker fills
and applies each row's token mask, the masked argmax picks a token and each matcher accepts it.
Random logits stand in for the model, so rows wander through the grammar as an unhelpful model
would; strings are pattern-bounded so every walk ends. Reported per step: the median and mean.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from benchmarks.common import machine_line, print_table, real_model_path

SCHEMA = {
    "type": "object",
    "additionalProperties": False,
    "required": ["name", "age", "tags"],
    "properties": {
        "name": {"type": "string", "pattern": "^[a-z ]{1,12}$"},
        "age": {"type": "integer"},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
    },
}


def step_times(compiler, masker, batch: int, steps: int, seed: int = 0) -> list[float]:
    from inference.structured_output import StructuredOutputs

    grammar = compiler.compile(StructuredOutputs(json=SCHEMA))
    matchers = [compiler.matcher(grammar) for _ in range(batch)]
    gen = torch.Generator().manual_seed(seed)
    times = []
    for _ in range(steps):
        logits = torch.randn(batch, compiler.vocab_size, generator=gen)
        live = [m if not m.is_terminated() else None for m in matchers]
        start = time.perf_counter()
        masker.apply(logits, live)
        for matcher, token in zip(live, logits.argmax(-1).tolist()):
            if matcher is not None:
                matcher.accept_token(token)
        times.append(time.perf_counter() - start)
        for i, matcher in enumerate(matchers):
            if matcher.is_terminated():  # a finished row starts a new answer, so every row stays constrained
                matchers[i] = compiler.matcher(grammar)
    return times


def main(argv=None) -> str:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", default="1,16,64")
    parser.add_argument("--steps", type=int, default=100)
    args = parser.parse_args(argv)
    from inference.loader import load_tokenizer
    from inference.structured_output import GrammarCompiler, TokenMasker

    tokenizer = load_tokenizer(real_model_path())
    compiler = GrammarCompiler(tokenizer, vocab_size=len(tokenizer), stop_token_ids=[tokenizer.eos_token_id])
    masker = TokenMasker(compiler.vocab_size)
    rows = []
    for batch in (int(b) for b in args.batches.split(",")):
        times = step_times(compiler, masker, batch, args.steps)
        rows.append([batch, statistics.median(times) * 1000, statistics.mean(times) * 1000])
    compiler.shutdown()
    return print_table(
        f"Grammar mask cost per step (xgrammar, {len(tokenizer):,}-token vocabulary), {machine_line()}",
        ["rows constrained", "p50 ms per step", "mean ms per step"],
        rows,
    )


if __name__ == "__main__":
    main()
