"""Shared pieces of the benchmarks: the bench models, workloads and table printing."""

from __future__ import annotations

import os
import random
import time
from pathlib import Path

import torch

BENCH_DIR = Path(os.environ.get("TESSERA_BENCH_DIR", Path(__file__).resolve().parents[1] / "var" / "bench"))

# The CPU bench model: ~31M params, a Llama with GQA (8 heads, 2 KV heads).
BENCH_CONFIG = dict(
    vocab_size=8192,
    hidden_size=512,
    intermediate_size=1408,
    num_hidden_layers=8,
    num_attention_heads=8,
    num_key_value_heads=2,
    max_position_embeddings=2048,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    tie_word_embeddings=False,
    bos_token_id=0,
    eos_token_id=1,
    initializer_range=0.02,
)


def bench_model_dir(dtype: str = "float32") -> str:
    """A random-weight Llama saved as an HF folder (built once, cached under var/bench).

    Its tokenizer is SmolLM2's (the workloads are random token ids below the model's vocabulary,
    so the tokenizer only decodes them).
    """
    folder = BENCH_DIR / f"llama-31m-{dtype}"
    if (folder / "config.json").exists():
        return str(folder)
    from transformers import LlamaConfig, LlamaForCausalLM

    from inference.loader import load_tokenizer

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**BENCH_CONFIG)).to(getattr(torch, dtype))
    model.save_pretrained(folder)
    load_tokenizer(real_model_path()).save_pretrained(folder)
    return str(folder)


def real_model_path() -> str:
    """SmolLM2-135M-Instruct, the GGUF file `make install` brings (the default served model)."""
    from inference.gguf_files import bundled_model

    return str(bundled_model())


# name -> (what the engine loads, how HF transformers loads the same weights)
BENCH_MODELS = {"random-31m": "the 31M random-weight Llama", "smollm2-135m": "SmolLM2-135M-Instruct (GGUF Q4_1)"}


def bench_model(name: str) -> str:
    if name == "random-31m":
        return bench_model_dir("float32")
    if name == "smollm2-135m":
        return real_model_path()
    raise ValueError(f"unknown bench model {name!r}; choose from {', '.join(BENCH_MODELS)}")


def hf_model(path: str, dtype: str):
    """HF transformers on the same weights (a GGUF file dequantized by transformers itself)."""
    from transformers import AutoModelForCausalLM

    from inference.gguf_files import is_gguf

    file = Path(path)
    where = (
        dict(pretrained_model_name_or_path=str(file.parent), gguf_file=file.name)
        if is_gguf(path)
        else dict(pretrained_model_name_or_path=path)
    )
    model = AutoModelForCausalLM.from_pretrained(**where, dtype=getattr(torch, dtype)).eval()
    model.generation_config.eos_token_id = None  # ignore_eos, as in the engine's workload
    return model


def random_workload(
    num_requests: int, prompt_range: tuple[int, int], output_range: tuple[int, int], seed: int = 0, vocab: int = 8192
) -> list[tuple[list[int], int]]:
    """(prompt token ids, output length) pairs, uniform lengths, random ids (no special tokens)."""
    rng = random.Random(seed)
    work = []
    for _ in range(num_requests):
        prompt = [rng.randrange(3, vocab) for _ in range(rng.randint(*prompt_range))]
        work.append((prompt, rng.randint(*output_range)))
    return work


class Timer:
    def __enter__(self):
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc):
        self.seconds = time.perf_counter() - self.start


def print_table(title: str, headers: list[str], rows: list[list]) -> str:
    """A Markdown table (printed and returned, so README tables are copied from real runs)."""
    lines = [f"### {title}", "", "| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    for row in rows:
        lines.append("| " + " | ".join(fmt(v) for v in row) + " |")
    text = "\n".join(lines) + "\n"
    print(text, flush=True)
    return text


def fmt(value) -> str:
    if isinstance(value, float):
        return f"{value:,.2f}" if abs(value) < 100 else f"{value:,.0f}"
    return str(value)


def machine_line() -> str:
    import platform

    gpu = f", {torch.cuda.get_device_name()}" if torch.cuda.is_available() else ""
    return (
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads{gpu}"
    )
