"""Start-up decisions the engine and every tensor-parallel rank make the same way."""

from __future__ import annotations

import ctypes

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


M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4  # glibc's mallopt parameters (malloc.h)
KEPT_FREE_BYTES = 1 << 30  # freed heap memory held for reuse before glibc returns any of it


def keep_freed_memory(device: torch.device) -> None:
    """On CPU, once the weights and the KV pool are allocated: glibc hands every block over 32 MiB (a long
    prefill chunk's MLP activations) to mmap and back to the OS when freed, so every step faulted those
    pages in again, and freed heap memory past 128 KiB was trimmed the same way. From here on large blocks
    come from the heap and freed memory stays there for the next step (docs/kernels.md has the cost).
    Process-wide; nothing where the C library has no mallopt (not glibc)."""
    libc = ctypes.CDLL(None)  # the process's own C library: no lookup
    mallopt = getattr(libc, "mallopt", None)
    if device.type == "cpu" and mallopt is not None:
        libc.malloc_trim(0)  # first hand back what loading freed (parsed tables, construction copies)
        mallopt(M_MMAP_MAX, 0)
        mallopt(M_TRIM_THRESHOLD, KEPT_FREE_BYTES)
