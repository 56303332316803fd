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

from tessera_kernels.quant_ref import int8_linear, quantize_int8_per_channel


class Int8LinearMethod:
    name = "int8"
    weight_dtype = "int8"

    def create_weights(self, layer: Any, in_features: int, out_features: int, dtype) -> None:
        layer.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=torch.int8), requires_grad=False)
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
        return int8_linear(x, layer.weight, layer.weight_scale, bias)

    def process_weights_after_loading(self, layer: Any) -> None:
        pass
