"""Train Tessera's demo model: a few-million-parameter Llama on Python's own documentation.

    python -m inference.demo.train --out var/models/tessera-demo [--steps N] [--minutes M]

Nothing can be downloaded, so the default model is trained on first run, on CPU, in a few
minutes, and saved as an ordinary Hugging Face folder (config.json, model.safetensors,
generation_config.json, tokenizer files with a chat template). A folder that is already
complete is left alone, so later runs start at once.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from . import COMPLETE_MARKER, is_complete
from .tokenizer import build_tokenizer, english_corpus, paragraphs_of, title_of

QUESTION_TEMPLATES = ("Tell me about {t}.", "What is {t}?", "Explain {t}.", "How does {t} work?",
                      "Describe {t}.", "{t}?")
GREETINGS = (
    ("Hello", "Hello! I am the Tessera demo model, a small language model trained on the Python "
              "documentation. Ask me about Python statements, expressions or types."),
    ("Hi", "Hi! I am a small demo model trained on the Python reference. Ask me about the for "
           "statement, lists, exceptions or classes."),
    ("Who are you?", "I am the Tessera demo model: a few million parameters trained for a few minutes "
                     "on the documentation that ships with Python."),
)


@dataclass
class DemoConfig:
    """Sizes chosen so that training fits a few minutes on 2 CPU cores (see docs/running.md)."""

    vocab_size: int = 4096
    hidden_size: int = 256
    intermediate_size: int = 704
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    max_position_embeddings: int = 2048
    seq_len: int = 256
    batch_size: int = 8
    steps: int = 800
    minutes: float = 4.0  # wall-clock budget; the LR schedule follows whichever runs out first
    lr: float = 3e-3
    warmup_steps: int = 30
    seed: int = 0
    threads: int = 2


def train_demo_model(out: str | Path, cfg: DemoConfig | None = None, progress: bool = True) -> Path:
    """Train and save the demo model to out (written to a temp folder, then renamed into place)."""
    cfg = cfg or DemoConfig()
    out = Path(out)
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    torch.manual_seed(cfg.seed)
    random.seed(cfg.seed)
    previous_threads = torch.get_num_threads()
    torch.set_num_threads(cfg.threads)
    try:
        docs = english_corpus()
        tokenizer = build_tokenizer(docs, cfg.vocab_size, tmp)
        stream = build_token_stream(tokenizer, docs, random.Random(cfg.seed))
        model = build_model(cfg, tokenizer)
        stats = fit(model, stream, cfg, progress)
        save_model(model, tokenizer, tmp, cfg, stats)
    finally:
        torch.set_num_threads(previous_threads)
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


def build_token_stream(tokenizer, docs: list[str], rng: random.Random) -> torch.Tensor:
    """Raw documents plus chat turns about them, shuffled and concatenated into one long tensor.

    The chat turns teach the model the template's shape, so the playground gets an answer that
    ends with EOS instead of endless documentation.
    """
    pieces = [tokenizer.backend_tokenizer.encode(doc).ids + [tokenizer.eos_token_id] for doc in docs]
    pieces += [_encode_chat(tokenizer, messages) for messages in chat_examples(docs, rng)]
    rng.shuffle(pieces)
    return torch.tensor([t for piece in pieces for t in piece], dtype=torch.long)


def chat_examples(docs: list[str], rng: random.Random) -> list[list[dict]]:
    examples = []
    for doc in docs:
        title = title_of(doc)
        title = "the" + title[3:] if title.startswith("The ") else title
        for paragraph in paragraphs_of(doc):
            question = rng.choice(QUESTION_TEMPLATES).format(t=title)
            examples.append([{"role": "user", "content": question}, {"role": "assistant", "content": paragraph}])
    for question, answer in GREETINGS:
        examples += [[{"role": "user", "content": question}, {"role": "assistant", "content": answer}]] * 8
    return examples


def _encode_chat(tokenizer, messages: list[dict]) -> list[int]:
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    return tokenizer.backend_tokenizer.encode(text, add_special_tokens=False).ids


def build_model(cfg: DemoConfig, tokenizer):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_hidden_layers,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads,
        max_position_embeddings=cfg.max_position_embeddings,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        torch_dtype="float32",
    )
    return LlamaForCausalLM(config)


def fit(model, stream: torch.Tensor, cfg: DemoConfig, progress: bool) -> dict:
    """AdamW on random windows of the stream; warmup, then cosine decay over steps or minutes."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.1)
    generator = torch.Generator().manual_seed(cfg.seed)
    model.train()
    start = time.monotonic()
    budget = cfg.minutes * 60
    bar = tqdm(total=cfg.steps, desc="training demo model", unit="step", disable=not progress,
               dynamic_ncols=True, file=sys.stdout)
    loss_avg, steps_done = None, 0
    for step in range(1, cfg.steps + 1):
        done = max((step - 1) / cfg.steps, (time.monotonic() - start) / budget)
        if done >= 1.0:
            break
        for group in optimizer.param_groups:
            group["lr"] = _lr(cfg, step, done)
        batch = _batch(stream, cfg, generator)
        loss = model(input_ids=batch, labels=batch).loss  # HF shifts the labels itself
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        loss_avg = loss.item() if loss_avg is None else 0.95 * loss_avg + 0.05 * loss.item()
        bar.set_postfix(loss=f"{loss_avg:.3f}", lr=f"{optimizer.param_groups[0]['lr']:.1e}")
        bar.update(1)
        steps_done = step
        _fit_bar_to_budget(bar, cfg.steps, step, time.monotonic() - start, budget)
    bar.close()
    if steps_done < cfg.steps:
        print(f"stopped after {steps_done} steps: the {cfg.minutes:g}-minute budget ran out", flush=True)
    return {"steps": steps_done, "seconds": round(time.monotonic() - start, 1), "final_loss": loss_avg}


def _fit_bar_to_budget(bar, max_steps: int, step: int, elapsed: float, budget: float) -> None:
    """Set the bar's total to the steps the time budget allows, so its ETA stays honest."""
    if step >= 10:
        projected = min(max_steps, max(step, int(step / elapsed * budget)))
        if projected != bar.total:
            bar.total = projected
            bar.refresh()


def _lr(cfg: DemoConfig, step: int, done: float) -> float:
    if step <= cfg.warmup_steps:
        return cfg.lr * step / cfg.warmup_steps
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(done, 1.0))))


def _batch(stream: torch.Tensor, cfg: DemoConfig, generator: torch.Generator) -> torch.Tensor:
    starts = torch.randint(0, len(stream) - cfg.seq_len, (cfg.batch_size,), generator=generator)
    return torch.stack([stream[s:s + cfg.seq_len] for s in starts.tolist()])


def save_model(model, tokenizer, out: Path, cfg: DemoConfig, stats: dict) -> None:
    from transformers import GenerationConfig

    model.eval()
    model.save_pretrained(out, safe_serialization=True)
    GenerationConfig(
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, do_sample=True, temperature=0.7, top_p=0.9,
        repetition_penalty=1.1, max_new_tokens=128,
    ).save_pretrained(out)
    params = sum(p.numel() for p in model.parameters())
    record = {"config": asdict(cfg), "parameters": params, **stats}
    (out / COMPLETE_MARKER).write_text(json.dumps(record, indent=2) + "\n")


def ensure_demo_model(path: str | Path, cfg: DemoConfig | None = None, progress: bool = True) -> Path:
    """The demo model at path, trained first if the folder is not complete yet."""
    path = Path(path)
    if is_complete(path):
        return path
    print(f"training the demo model into {path} (first run only; a few minutes on CPU)", flush=True)
    return train_demo_model(path, cfg, progress)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    defaults = DemoConfig()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="folder to write the Hugging Face model to")
    parser.add_argument("--steps", type=int, default=int(os.environ.get("DEMO_TRAIN_STEPS", defaults.steps)))
    parser.add_argument("--minutes", type=float, default=float(os.environ.get("DEMO_TRAIN_MINUTES", defaults.minutes)),
                        help="wall-clock budget")
    parser.add_argument("--threads", type=int, default=int(os.environ.get("DEMO_TRAIN_THREADS", defaults.threads)))
    parser.add_argument("--force", action="store_true", help="retrain even if the folder is complete")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    cfg = DemoConfig(steps=args.steps, minutes=args.minutes, threads=args.threads)
    if is_complete(args.out) and not args.force:
        print(f"{args.out} is already complete; pass --force to retrain")
        return
    out = train_demo_model(args.out, cfg)
    record = json.loads((out / COMPLETE_MARKER).read_text())
    print(f"saved {record['parameters'] / 1e6:.1f}M-parameter model to {out} "
          f"({record['steps']} steps, {record['seconds']} s, loss {record['final_loss']:.2f})")


if __name__ == "__main__":
    main()
