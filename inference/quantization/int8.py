"""Weight-only int8, one scale per output channel, quantized while a float checkpoint loads.

Each checkpoint tensor is quantized as it arrives (before this rank's slice is cut), so the float
copy of the model never exists at once and the scales equal the single-device ones: a scale only
depends on its own output row, and row-parallel layers keep every row's whole-row scale.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn

from inference.quantization.packed_int4 import cpu_kernels_take, pack_for_cpu, packed_linear
from tessera_kernels.quant_ref import int8_linear, quantize_int8_per_channel


class Int8LinearMethod:
    name = "int8"
    weight_dtype = "int8"

    def create_weights(self, layer: Any, in_features: int, out_features: int, dtype) -> None:
        layer.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=torch.int8), requires_grad=False)
        layer.compute_dtype = dtype
        layer.weight_scale = nn.Parameter(torch.empty(out_features, dtype=torch.float32), requires_grad=False)
        setattr(layer.weight_scale, "derived", True)  # filled by the weight's loader, absent from checkpoints
        setattr(layer.weight, "weight_loader", functools.partial(self.load_weight, layer))
        setattr(layer.weight_scale, "weight_loader", layer.weight_loader)

    @staticmethod
    def load_weight(layer: Any, param, loaded: torch.Tensor, shard_id=None) -> None:
        q, scale = quantize_int8_per_channel(loaded)
        layer.weight_loader(layer.weight, q, shard_id)
        layer.weight_loader(layer.weight_scale, scale, shard_id)

    def apply(self, layer: Any, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if (out := packed_linear(layer, x, bias)) is not None:
            return out
        return int8_linear(x, layer.weight, layer.weight_scale, bias)

    def process_weights_after_loading(self, layer: Any) -> None:
        if cpu_kernels_take(layer.weight, layer.compute_dtype):
            pack_for_cpu(layer, int8_blocks(layer.weight, layer.weight_scale), ("weight", "weight_scale"))


def int8_blocks(q: torch.Tensor, scale: torch.Tensor):
    """An int8 weight [N, K] with one scale per output as Q8_0 blocks of 32 inputs, d = the row's scale
    rounded to float16: (kind, blocks, None) as int4_blocks gives it; None where K is not whole blocks."""
    n, k = q.shape
    if k % 32:
        return None
    d = scale.to(torch.float16)[:, None, None].expand(n, k // 32, 1).contiguous().view(torch.uint8)
    blocks = torch.cat([d, q.reshape(n, -1, 32).view(torch.uint8)], dim=-1)
    return "Q8_0", blocks.reshape(n, -1).contiguous(), None
