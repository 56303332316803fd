"""One linear-layer interface with pluggable weight formats and tensor-parallel sharding.

Every parameter carries a `weight_loader(param, loaded_weight, shard_id=None)` that knows how to
cut this rank's slice out of a checkpoint tensor, so models never deal with sharding or
quantization themselves. A LinearMethod creates the parameters and computes the product; the
unquantized one is below, quantized formats plug in the same way.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

import torch
from torch import nn

from inference.distributed import SINGLE, ParallelConfig, all_reduce
from inference.layers import onednn

# The decode rows (laid out first) of the step in progress, set by ModelRunner.execute for the body and
# for the logits' rows: packed linears (the LM head's too) compute them apart from the step's prefill
# chunks (tessera_kernels.quant_cpu.linear).
STEP_DECODE_ROWS: ContextVar[int] = ContextVar("step_decode_rows", default=0)


@contextmanager
def step_decode_rows(count: int) -> Iterator[None]:
    token = STEP_DECODE_ROWS.set(count)
    try:
        yield
    finally:
        STEP_DECODE_ROWS.reset(token)


class UnquantizedLinearMethod:
    """A plain [out, in] weight in the model's dtype, packed for oneDNN on CPU after loading."""

    def create_weights(self, layer: Any, in_features: int, out_features: int, dtype) -> None:
        weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype), requires_grad=False)
        layer.weight = with_loader(weight, layer.weight_loader)

    def apply(self, layer: Any, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if layer.weight.is_mkldnn:
            return onednn.linear(x, layer.weight, bias)
        return nn.functional.linear(x, layer.weight, bias)

    def process_weights_after_loading(self, layer: Any) -> None:
        if onednn.can_pack(layer.weight):  # replaces the dense copy: no extra memory
            layer.weight = nn.Parameter(onednn.pack(layer.weight.data), requires_grad=False)


class LinearBase(nn.Module):
    """in_features x out_features held by this rank; subclasses say how checkpoints are cut."""

    def __init__(
        self, in_features: int, out_features: int, bias: bool, dtype, method=None, parallel: ParallelConfig = SINGLE
    ):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.parallel = parallel  # before create_weights: quantized formats lay out groups by it
        self.method = method or UnquantizedLinearMethod()
        self.method.create_weights(self, in_features, out_features, dtype)
        self.bias: nn.Parameter | None = None
        if bias:
            self.bias = with_loader(
                nn.Parameter(torch.empty(out_features, dtype=dtype), requires_grad=False), self.weight_loader
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.method.apply(self, x, self.bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        copy_checked(param.data, loaded)


class ColumnParallelLinear(LinearBase):
    """Output features split across ranks (dim 0 of the [out, in] weight)."""

    def __init__(
        self, in_features: int, out_features: int, bias: bool, dtype, method=None, parallel: ParallelConfig = SINGLE
    ):
        super().__init__(in_features, divide(out_features, parallel.size), bias, dtype, method, parallel)

    def weight_loader(self, param, loaded, shard_id=None):
        dim = output_dim(param)
        if dim is None:  # replicated along the output (e.g. GPTQ's g_idx)
            copy_checked(param.data, loaded)
            return
        size = param.shape[dim]
        copy_checked(param.data, loaded.narrow(dim, self.parallel.rank * size, size))


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel outputs in one matmul (gate and up): shard_id is the index."""

    def __init__(
        self, in_features: int, out_sizes: list[int], bias: bool, dtype, method=None, parallel: ParallelConfig = SINGLE
    ):
        self.out_sizes = out_sizes
        super().__init__(in_features, sum(out_sizes), bias, dtype, method, parallel)

    def weight_loader(self, param, loaded, shard_id=None):
        dim = output_dim(param)
        if dim is None:
            copy_checked(param.data, loaded)
            return
        if shard_id is None:  # a checkpoint that stores the outputs fused (Phi-3's gate_up_proj)
            load_fused(self.weight_loader, param, loaded, dim, dict(enumerate(self.out_sizes)))
            return
        per_rank = [stored_size(param, divide(s, self.parallel.size)) for s in self.out_sizes]
        offset = sum(per_rank[:shard_id])
        size = per_rank[shard_id]
        copy_checked(param.data.narrow(dim, offset, size), loaded.narrow(dim, self.parallel.rank * size, size))


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v projections in one matmul, split by heads (GQA-aware).

    With fewer KV heads than ranks, each KV head is replicated on tp_size / num_kv_heads ranks.
    """

    def __init__(
        self,
        hidden: int,
        head_dim: int,
        num_heads: int,
        num_kv_heads: int,
        bias: bool,
        dtype,
        method=None,
        parallel: ParallelConfig = SINGLE,
    ):
        size = parallel.size
        self.head_dim = head_dim
        self.num_heads = divide(num_heads, size)
        self.num_kv_heads = max(1, num_kv_heads // size)
        self.kv_replicas = max(1, size // num_kv_heads)
        self.checkpoint_sizes = (num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim)
        out = (self.num_heads + 2 * self.num_kv_heads) * head_dim * size
        super().__init__(hidden, out, bias, dtype, method, parallel)

    @property
    def output_sizes(self) -> tuple[int, int, int]:
        return (self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim, self.num_kv_heads * self.head_dim)

    def weight_loader(self, param, loaded, shard_id=None):
        dim = output_dim(param)
        if dim is None:
            copy_checked(param.data, loaded)
            return
        if shard_id is None:  # a checkpoint that stores q, k and v fused (Phi-3's qkv_proj)
            load_fused(self.weight_loader, param, loaded, dim, dict(zip("qkv", self.checkpoint_sizes)))
            return
        q_size, kv_size = (stored_size(param, n) for n in self.output_sizes[:2])
        if shard_id == "q":
            offset, size, rank_index = 0, q_size, self.parallel.rank
        else:
            offset = q_size if shard_id == "k" else q_size + kv_size
            size, rank_index = kv_size, self.parallel.rank // self.kv_replicas
        copy_checked(param.data.narrow(dim, offset, size), loaded.narrow(dim, rank_index * size, size))


class RowParallelLinear(LinearBase):
    """Input features split across ranks; partial products are summed by an all-reduce."""

    def __init__(
        self, in_features: int, out_features: int, bias: bool, dtype, method=None, parallel: ParallelConfig = SINGLE
    ):
        super().__init__(divide(in_features, parallel.size), out_features, bias, dtype, method, parallel)

    def weight_loader(self, param, loaded, shard_id=None):
        dim = input_dim(param)
        if dim is None:  # the bias is added once, after the reduction; per-channel scales are whole
            copy_checked(param.data, loaded)
            return
        size = param.shape[dim]
        copy_checked(param.data, loaded.narrow(dim, self.parallel.rank * size, size))

    def forward(self, x):
        out = all_reduce(self.method.apply(self, x, None), self.parallel)
        return out if self.bias is None else out + self.bias


def load_fused(weight_loader, param, loaded, dim: int, sizes: dict) -> None:
    """Cut a checkpoint tensor that holds several shards one after another (whole-model output
    features per shard id, in order) and load each shard as if it had come on its own."""
    stored = {shard_id: stored_size(param, features) for shard_id, features in sizes.items()}
    if sum(stored.values()) != loaded.shape[dim]:
        raise ValueError(f"a fused checkpoint tensor of {loaded.shape[dim]} outputs does not split into {sizes}")
    start = 0
    for shard_id, size in stored.items():
        weight_loader(param, loaded.narrow(dim, start, size), shard_id)
        start += size


# Where a parameter keeps its output and input features. A plain weight is [out, in]; quantized
# formats set `output_dim` / `input_dim` on their parameters (None: not split along that side)
# and `output_pack`, the number of output features per stored element (8 int4 in one int32).
def output_dim(param) -> int | None:
    return getattr(param, "output_dim", 0)


def input_dim(param) -> int | None:
    return getattr(param, "input_dim", 1 if param.dim() == 2 else None)


def stored_size(param, num_output_features: int) -> int:
    pack = getattr(param, "output_pack", 1)
    if num_output_features % pack:
        raise ValueError(f"{num_output_features} output features per rank do not fill packs of {pack}")
    return num_output_features // pack


def divide(numerator: int, denominator: int) -> int:
    if numerator % denominator:
        raise ValueError(f"{numerator} is not divisible by tensor_parallel_size {denominator}")
    return numerator // denominator


def with_loader(param: nn.Parameter, loader) -> nn.Parameter:
    """`param` carrying its weight_loader (an attribute torch's Parameter does not declare)."""
    setattr(param, "weight_loader", loader)
    return param


def copy_checked(dst: torch.Tensor, src: torch.Tensor) -> None:
    if dst.shape != src.shape:
        raise ValueError(f"checkpoint tensor of shape {tuple(src.shape)} does not fit parameter {tuple(dst.shape)}")
    dst.copy_(src)
