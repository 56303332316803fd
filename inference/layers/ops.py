"""The one interface the model code calls for its hot operations.

A backend is chosen once at start-up ("torch" on CPU, "triton" on CUDA, overridable with
`attention_backend=`); layers never branch on the device themselves.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels import torch_ref


@dataclass
class AttentionMetadata:
    """Per-step layout of the flattened batch (see kernels/torch_ref.py for the conventions)."""

    slot_mapping: torch.Tensor  # int64 [num_tokens]
    query_start_loc: torch.Tensor  # int32 [num_seqs + 1]
    seq_lens: torch.Tensor  # int32 [num_seqs]
    block_tables: torch.Tensor  # int32 [num_seqs, max_blocks]
    decode_only: bool  # every sequence has exactly one new token


class TorchOps:
    """Reference ops: what the engine runs on CPU."""

    name = "torch"

    def store_kv(self, k, v, k_cache, v_cache, slot_mapping):
        torch_ref.store_kv_cache(k, v, k_cache, v_cache, slot_mapping)

    def attention(self, q, k_cache, v_cache, meta: AttentionMetadata, scale: float):
        if meta.decode_only:
            return torch_ref.paged_decode_attention(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, scale)
        return torch_ref.paged_prefill_attention(
            q, k_cache, v_cache, meta.block_tables, meta.query_start_loc, meta.seq_lens, scale
        )

    def fused_add_rms_norm(self, x, residual, weight, eps):
        return torch_ref.fused_add_rms_norm(x, residual, weight, eps)

    def rotary(self, positions, q, k, cos_sin_cache):
        torch_ref.rotary_embedding(positions, q, k, cos_sin_cache)

    def silu_and_mul(self, x):
        return torch_ref.silu_and_mul(x)


def get_ops(name: str):
    """Backend by name: "torch" or "triton" (the latter imports Triton lazily)."""
    if name == "torch":
        return TorchOps()
    if name == "triton":
        from inference.layers.triton_ops import TritonOps

        return TritonOps()
    raise ValueError(f"unknown attention_backend {name!r}; expected 'torch' or 'triton'")
