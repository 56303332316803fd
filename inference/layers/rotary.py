"""Rotary position embedding tables (neox style), with llama3, linear or LongRoPE scaling when configured."""

from __future__ import annotations

import math

import torch


def inverse_frequencies(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    powers = theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim)
    if not scaling:
        return 1.0 / powers
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "longrope":  # the short factors: the context is capped where they hold (config.py)
        return 1.0 / (torch.tensor(scaling["short_factor"], dtype=torch.float32) * powers)
    inv_freq = 1.0 / powers
    if kind == "llama3":
        return llama3_scaled(inv_freq, scaling)
    if kind == "linear":
        return inv_freq / scaling["factor"]
    raise ValueError(f"unsupported rope_scaling type {kind!r}; supported: llama3, linear, longrope")


def llama3_scaled(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    """Llama 3.1: keep high frequencies, divide low ones by factor, blend in between."""
    factor = scaling["factor"]
    low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
    old_len = scaling["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, blended, scaled)


def cos_sin_cache(head_dim: int, max_position: int, theta: float, scaling: dict | None, dtype) -> torch.Tensor:
    """[max_position, head_dim]: cos in the first half of each row, sin in the second."""
    inv_freq = inverse_frequencies(head_dim, theta, scaling)
    freqs = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq)
    factor = (scaling or {}).get("attention_factor", 1.0)  # LongRoPE scales cos and sin alike
    cos, sin = (freqs.cos(), freqs.sin()) if factor == 1.0 else (freqs.cos() * factor, freqs.sin() * factor)
    return torch.cat([cos, sin], dim=-1).to(dtype)
