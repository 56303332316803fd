"""AWQ 4-bit checkpoints (AutoAWQ "gemm" version): qweight, qzeros and scales; layouts in
kernels/tessera_kernels/quant_ref.py. Groups always follow the inputs in order, so row-parallel shards split the
scales and zeros with the inputs.
"""

from __future__ import annotations

from typing import Any

import torch

from inference.quantization.packed_int4 import (
    PACK,
    bind_loaders,
    group_layout,
    local_g_idx,
    pack_int4_for_cpu,
    packed_linear,
    packed_param,
    use_triton,
)
from tessera_kernels.quant_ref import AWQ_UNPACK_ORDER, awq_linear, unpack_int4_cols


class AWQLinearMethod:
    name = "awq"
    weight_dtype = "int4"

    def __init__(self, group_size: int = 128):
        self.group_size = group_size

    @classmethod
    def from_config(cls, qcfg: dict) -> "AWQLinearMethod":
        if qcfg.get("bits", qcfg.get("w_bit", 4)) != 4:
            raise ValueError("only 4-bit AWQ is supported")
        if str(qcfg.get("version", "gemm")).lower() != "gemm":
            raise ValueError(f"unsupported AWQ version {qcfg.get('version')!r}; only 'gemm' checkpoints load")
        if not qcfg.get("zero_point", True):
            raise ValueError("AWQ checkpoints without zero points are not supported")
        return cls(qcfg.get("group_size", qcfg.get("q_group_size", 128)))

    def create_weights(self, layer: Any, in_features: int, out_features: int, dtype) -> None:
        group, groups, split = group_layout(layer, in_features, self.group_size, replicate_groups=False)
        group_dim = 0 if split else None
        layer.quant_group_size = group
        layer.qweight = packed_param((in_features, out_features // PACK), torch.int32, 1, 0, PACK)
        layer.qzeros = packed_param((groups, out_features // PACK), torch.int32, 1, group_dim, PACK)
        layer.scales = packed_param((groups, out_features), dtype, 1, group_dim)
        bind_loaders(layer, ("qweight", "qzeros", "scales"))
        # The kernel looks groups up per input row, as for GPTQ; not a checkpoint tensor.
        layer.register_buffer("g_idx", local_g_idx(in_features, group, None), persistent=False)

    def apply(self, layer: Any, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if (out := packed_linear(layer, x, bias)) is not None:
            return out
        if use_triton(x):
            from tessera_kernels.dequant_gemm import dequant_gemm

            return dequant_gemm(x, layer.qweight, layer.qzeros, layer.scales, layer.g_idx, "awq", 0, bias)
        return awq_linear(x, layer.qweight, layer.qzeros, layer.scales, layer.quant_group_size, bias)

    def process_weights_after_loading(self, layer: Any) -> None:
        pack_int4_for_cpu(
            layer,
            lambda: (
                unpack_int4_cols(layer.qweight, AWQ_UNPACK_ORDER),
                unpack_int4_cols(layer.qzeros, AWQ_UNPACK_ORDER),
            ),
        )
