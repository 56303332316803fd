"""Start-up decisions the engine and every tensor-parallel rank make the same way."""

from __future__ import annotations

import torch

from inference.config import ModelConfig
from inference.layers.ops import get_ops


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError("device='cuda' was asked for but no CUDA device is available")
    return torch.device(device)


def resolve_max_model_len(cfg: ModelConfig, asked: int | None) -> int:
    limit = cfg.max_position_embeddings
    if cfg.sliding_window:
        limit = min(limit, cfg.sliding_window)
    if asked is None:
        return limit
    if asked > limit:
        raise ValueError(f"max_model_len {asked} exceeds the model's limit of {limit} positions")
    return asked


def choose_ops(args, device: torch.device):
    """attention_backend if given, else Triton on CUDA and the torch reference elsewhere."""
    return get_ops(args.attention_backend or ("triton" if device.type == "cuda" else "torch"))


def weight_bytes(model: torch.nn.Module) -> int:
    """The bytes a batch-1 decode step reads: every parameter once."""
    return sum(p.numel() * p.element_size() for p in model.parameters())
