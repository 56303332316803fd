"""What GPTQ and AWQ share: int4 weights in int32 words, zeros and scales per group of inputs.

Parameter shapes are this rank's; every parameter says where its output and input features are
(`output_dim`, `input_dim`, `output_pack`) so the layer's weight_loader can cut tensor-parallel
shards of packed tensors exactly as it cuts float ones. The product runs the Triton
dequantize-GEMM on CUDA and, on CPU, the C kernels of a GGUF file's layers on the weight repacked
into ggml blocks after loading (pack_for_cpu); the torch reference (dequantize, then matmul) where
no block layout fits or the model computes in float16.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from inference.quantization.gguf import Segment, segment_linear
from tessera_kernels import native_cpu, quant_cpu

PACK = 8


def packed_param(shape, dtype, output_dim, input_dim, output_pack=1) -> nn.Parameter:
    param = nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)
    for name, value in (("output_dim", output_dim), ("input_dim", input_dim), ("output_pack", output_pack)):
        setattr(param, name, value)  # attributes the loader reads; torch's Parameter does not declare them
    return param


def bind_loaders(layer: Any, names) -> None:
    for name in names:
        getattr(layer, name).weight_loader = layer.weight_loader


def group_layout(layer: Any, in_features: int, group_size: int, replicate_groups: bool) -> tuple[int, int, bool]:
    """(group size, number of groups held, whether groups are split with the input features).

    A row-parallel layer holds in_features / tp of the inputs; its groups split with them unless
    the groups cannot follow the split (act-order g_idx, group_size -1), then every rank keeps all.
    """
    from inference.layers.linear import RowParallelLinear

    row, tp_size = isinstance(layer, RowParallelLinear), layer.parallel.size
    full_in = in_features * tp_size if row else in_features
    group = full_in if group_size == -1 else group_size
    if in_features % PACK or layer.out_features % PACK:
        raise ValueError(
            f"int4 layers need in/out features divisible by {PACK}; got {in_features}x{layer.out_features}"
        )
    split = row and tp_size > 1 and not replicate_groups and group_size != -1
    if split and in_features % group:
        raise ValueError(
            f"group_size {group} does not divide the {in_features} input features per rank of "
            f"{type(layer).__name__}; use a tensor_parallel_size that keeps whole groups"
        )
    groups = in_features // group if split else -(-full_in // group)
    return group, groups, split


def local_g_idx(in_features: int, group: int, device) -> torch.Tensor:
    """The group of each input this rank holds when groups follow the inputs in order."""
    return (torch.arange(in_features, device=device) // group).to(torch.int32)


def use_triton(x: torch.Tensor) -> bool:
    return x.is_cuda


def int4_blocks(q: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, groups: torch.Tensor):
    """An int4 weight (codes q [K, N] in 0..15, per-group zeros and scales [G, N], each input's group [K]) as
    ggml blocks of 32 inputs: Q4_0, d (q - 8), where every zero is 8 (GPTQ's symmetric checkpoints: exact),
    else Q4_1, d q + m with m = -zero d rounded to float16. Act-order inputs are sorted by group first.
    (kind, blocks [N, K / 32 * block bytes] uint8, the input order or None), or None where a block of 32
    inputs would still span two groups (an act-order layer's inputs split across ranks)."""
    order = None
    if not bool((groups[1:] >= groups[:-1]).all()):
        order = torch.argsort(groups, stable=True)
        q, groups = q[order], groups[order]
    if q.shape[0] % 32:
        return None
    by_block = groups.reshape(-1, 32)
    if not bool((by_block == by_block[:, :1]).all()):
        return None
    g = by_block[:, 0].long()
    d = scales[g].t().to(torch.float16)  # [N, K / 32]
    if bool((zeros == 8).all()):
        kind, header = "Q4_0", d.unsqueeze(-1)
    else:
        m = -(zeros[g].t().float() * scales[g].t().float())
        kind, header = "Q4_1", torch.stack([d, m.to(torch.float16)], dim=-1)
    codes = q.t().reshape(q.shape[1], -1, 32).to(torch.uint8)
    nibbles = codes[..., :16] | (codes[..., 16:] << 4)  # ggml: value j in the low nibble of byte j, j + 16 high
    blocks = torch.cat([header.contiguous().view(torch.uint8), nibbles], dim=-1)
    return kind, blocks.reshape(q.shape[1], -1).contiguous(), order


def cpu_kernels_take(param: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether a layer whose weight lives where `param` does, computing in `dtype`, runs on the C kernels
    (pack_for_cpu): on CPU, in float32 or bfloat16 (float16 keeps the reference path)."""
    return param.device.type == "cpu" and dtype in native_cpu.SUPPORTED_DTYPES and native_cpu.load() is not None


def pack_int4_for_cpu(layer: Any, codes: Callable[[], tuple[torch.Tensor, torch.Tensor]]) -> None:
    """process_weights_after_loading's CPU step for GPTQ and AWQ: `codes()` unpacks the layer's (codes [K, N],
    zeros [G, N]), only where the C kernels take the layer."""
    if cpu_kernels_take(layer.qweight, layer.scales.dtype):
        q, zeros = codes()
        pack_for_cpu(layer, int4_blocks(q, zeros, layer.scales, layer.g_idx), ("qweight", "qzeros", "scales"))


def pack_for_cpu(layer: Any, found, drop: tuple[str, ...]) -> None:
    """After loading, on CPU: the layer's weight as one packed segment (inference/quantization/gguf.py), which
    the C kernels of tessera_kernels.quant_cpu multiply as they do a GGUF file's; `drop` names the
    checkpoint's own tensors, freed. `found`: (kind, blocks, input order or None) as int4_blocks gives it;
    None keeps the reference path (dequantize, then matmul)."""
    if found is None:
        return
    kind, blocks, order = found
    kind, blocks = quant_cpu.kernel_layout(kind, blocks, layer.in_features, in_place=True)
    for name in drop:
        delattr(layer, name)
    layer.weight_0 = nn.Parameter(blocks, requires_grad=False)
    layer.segments = [Segment(0, blocks.shape[0], kind, "weight_0")]
    layer.register_buffer("input_order", order, persistent=False)


def packed_linear(layer: Any, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
    """The product on the layer's packed segment (pack_for_cpu), or None where it has none."""
    if not getattr(layer, "segments", None):
        return None
    if layer.input_order is not None:
        x = x.index_select(1, layer.input_order)
    return segment_linear(layer, layer.segments[0], x, bias)
