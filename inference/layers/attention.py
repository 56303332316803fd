"""Paged attention layer: store this step's K/V into the cache, then attend through block tables."""

from __future__ import annotations

import torch
from torch import nn

from inference.layers.ops import AttentionMetadata


class PagedAttention(nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, ops):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = head_dim**-0.5
        self.ops = ops
        self.k_cache = self.v_cache = torch.empty(0)  # bound by the model runner

    def forward(self, q, k, v, meta: AttentionMetadata) -> torch.Tensor:
        """q [T, Hq, D], k/v [T, Hkv, D] -> [T, Hq * D]."""
        self.ops.store_kv(k, v, self.k_cache, self.v_cache, meta.slot_mapping)
        out = self.ops.attention(q, self.k_cache, self.v_cache, meta, self.scale)
        return out.reshape(q.shape[0], self.num_heads * self.head_dim)
