"""Tessera's demo model: a small Llama trained on CPU on the English documentation that ships with Python.

    from inference.demo import ensure_demo_model
    ensure_demo_model("var/models/tessera-demo")   # trains on first call (a few minutes), then cached

or `python -m inference.demo.train --out DIR [--steps N] [--minutes M]`.
"""
from __future__ import annotations

from pathlib import Path

__all__ = ["ensure_demo_model", "is_complete", "train_demo_model", "DemoConfig", "build_tokenizer", "english_corpus"]


REQUIRED_FILES = ("config.json", "model.safetensors", "generation_config.json", "tokenizer.json",
                  "tokenizer_config.json", "special_tokens_map.json")
COMPLETE_MARKER = "demo_training.json"  # written last: its presence means training finished


def is_complete(path: str | Path) -> bool:
    """True when path holds a finished demo model (cheap: no torch import)."""
    path = Path(path)
    return (path / COMPLETE_MARKER).exists() and all((path / f).exists() for f in REQUIRED_FILES)


def ensure_demo_model(path: str | Path, cfg=None, progress: bool = True) -> Path:
    """The demo model folder at path, trained first if it is not complete yet."""
    from .train import ensure_demo_model as _ensure

    return _ensure(path, cfg, progress)


def __getattr__(name: str):
    # Lazy, so that checking a folder (is_complete) does not import torch and transformers.
    if name in ("train_demo_model", "DemoConfig"):
        from . import train

        return getattr(train, name)
    if name in ("build_tokenizer", "english_corpus"):
        from . import tokenizer

        return getattr(tokenizer, name)
    raise AttributeError(name)
