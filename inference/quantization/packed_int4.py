"""What GPTQ and AWQ share: int4 weights in int32 words, zeros and scales per group of inputs.

Parameter shapes are this rank's; every parameter says where its output and input features are
(`output_dim`, `input_dim`, `output_pack`) so the layer's weight_loader can cut tensor-parallel
shards of packed tensors exactly as it cuts float ones. The product runs the Triton
dequantize-GEMM on CUDA and the torch reference (dequantize, then matmul) elsewhere.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

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
