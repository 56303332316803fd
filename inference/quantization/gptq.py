"""GPTQ 4-bit checkpoints (AutoGPTQ / GPTQModel "gptq" format): qweight, qzeros, scales, g_idx.

Layouts in kernels/tessera_kernels/quant_ref.py. Act-order (desc_act) checkpoints give every input row a group
through g_idx; the Triton kernel looks groups up through g_idx, so no reordering is needed there (the CPU's
block layout sorts the inputs by group: packed_int4.int4_blocks). Row-parallel
shards of an act-order layer keep all the groups' scales and zeros (a rank's inputs may belong to
any group); otherwise scales and zeros are split with the inputs.
"""

from __future__ import annotations

import functools
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
from tessera_kernels.quant_ref import gptq_linear, unpack_int4_cols, unpack_int4_rows


class GPTQLinearMethod:
    name = "gptq"
    weight_dtype = "int4"

    def __init__(self, group_size: int = 128, desc_act: bool = False, zero_offset: int = 1):
        self.group_size, self.desc_act, self.zero_offset = group_size, desc_act, zero_offset

    @classmethod
    def from_config(cls, qcfg: dict) -> "GPTQLinearMethod":
        if qcfg.get("bits", 4) != 4:
            raise ValueError(f"only 4-bit GPTQ is supported; the checkpoint has bits={qcfg.get('bits')}")
        fmt = qcfg.get("checkpoint_format", "gptq")
        if fmt not in ("gptq", "gptq_v2"):
            raise ValueError(f"unsupported GPTQ checkpoint_format {fmt!r}")
        # v1 stores zero - 1 (AutoGPTQ's historic convention); v2 stores the zero itself.
        return cls(qcfg.get("group_size", 128), bool(qcfg.get("desc_act", False)), 1 if fmt == "gptq" else 0)

    def create_weights(self, layer: Any, in_features: int, out_features: int, dtype) -> None:
        group, groups, split = group_layout(layer, in_features, self.group_size, self.desc_act)
        group_dim = 0 if split else None
        layer.quant_group_size = group
        layer.qweight = packed_param((in_features // PACK, out_features), torch.int32, 1, 0)
        layer.qzeros = packed_param((groups, out_features // PACK), torch.int32, 1, group_dim, PACK)
        layer.scales = packed_param((groups, out_features), dtype, 1, group_dim)
        layer.g_idx = packed_param((in_features,), torch.int32, None, 0)
        layer.g_idx.optional = True  # desc_act=False checkpoints may leave it out
        bind_loaders(layer, ("qweight", "qzeros", "scales"))
        layer.g_idx.weight_loader = functools.partial(self.load_g_idx, layer)

    @staticmethod
    def load_g_idx(layer: Any, param, loaded: torch.Tensor, shard_id=None) -> None:
        """Merged projections (q/k/v, gate/up) read one input, so their act-order g_idx must agree."""
        before = param.data.clone() if getattr(layer, "g_idx_loaded", False) else None
        layer.weight_loader(param, loaded, shard_id)
        if before is not None and not torch.equal(before, param.data):
            raise ValueError(
                "act-order g_idx differs between projections merged into one layer "
                f"({type(layer).__name__}); the checkpoint cannot be merged"
            )
        layer.g_idx_loaded = True

    def apply(self, layer: Any, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if (out := packed_linear(layer, x, bias)) is not None:
            return out
        if use_triton(x):
            from tessera_kernels.dequant_gemm import dequant_gemm

            return dequant_gemm(
                x, layer.qweight, layer.qzeros, layer.scales, layer.g_idx, "gptq", self.zero_offset, bias
            )
        return gptq_linear(x, layer.qweight, layer.qzeros, layer.scales, layer.g_idx, bias, self.zero_offset)

    def process_weights_after_loading(self, layer: Any) -> None:
        if not self.desc_act:  # groups in input order: recompute for this rank's inputs
            layer.g_idx.data = local_g_idx(layer.g_idx.shape[0], layer.quant_group_size, layer.g_idx.device)
        pack_int4_for_cpu(
            layer, lambda: (unpack_int4_rows(layer.qweight), unpack_int4_cols(layer.qzeros) + self.zero_offset)
        )
