"""GGUF weights kept in their block formats (`weights="packed"`): the linear layers multiply the file's
blocks directly with the C kernels of kernels/tessera_kernels/quant_cpu.py (in the layout those read
fastest, quant_cpu.kernel_layout: the same bytes); nothing is dequantized at load.

A layer's checkpoint tensors arrive as PackedTensor (the file's bytes, [rows, row_bytes] uint8, and
the ggml type) or, for F32/F16/BF16 matrices, as float tensors. Merged layers (QKV, gate/up) often
mix types in one Q4_K_M file (Q4_K for q, Q6_K for v), so a layer keeps one segment per run of
output rows of one type: same-type shards are joined, and each segment writes its columns of the
output.

Types without a kernel (the IQ*, TQ* and *FP4 families) are converted at load to Q8_0, the smallest
kernel type that holds their values without a second rounding of note (8 bits against their 1.5-4.5).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from inference.layers.embedding import ParallelLMHead
from inference.layers.linear import STEP_DECODE_ROWS, LinearBase, with_loader
from tessera_kernels import quant_cpu

SHARD_ORDER = {"q": 0, "k": 1, "v": 2}
REPACK_TYPE = "Q8_0"


@dataclass
class PackedTensor:
    """One GGUF matrix as the file stores it: `rows` output features of `in_features` blocks-packed values."""

    kind: str
    data: torch.Tensor  # [rows, row_bytes] uint8
    in_features: int

    @property
    def shape(self) -> tuple[int, int]:
        return (self.data.shape[0], self.in_features)


def from_gguf_array(kind: str, data, in_features: int) -> PackedTensor:
    """A GGUF tensor's bytes as a PackedTensor, converted to REPACK_TYPE when no kernel takes `kind`, in the
    layout the kernels read (quant_cpu.kernel_layout)."""
    import numpy as np

    if kind not in quant_cpu.KERNEL_TYPES:
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize, quantize

        values = dequantize(np.asarray(data), GGMLQuantizationType[kind])
        data, kind = (
            quantize(np.ascontiguousarray(values, dtype=np.float32), GGMLQuantizationType[REPACK_TYPE]),
            REPACK_TYPE,
        )
    blocks = torch.from_numpy(np.array(data, dtype=np.uint8))
    kind, blocks = quant_cpu.kernel_layout(kind, blocks, in_features, in_place=True)
    return PackedTensor(kind, blocks, in_features)


@dataclass
class Segment:
    """Output columns [start, start + rows) of a layer, computed from one weight of one type."""

    start: int
    rows: int
    kind: str  # a ggml type, or "dense" for a float weight
    name: str  # the layer's parameter holding the weight


class GGUFLinearMethod:
    name = "gguf"
    weight_dtype = "packed"

    # `layer` is a LinearBase that this method gives attributes of its own (gguf_shards, segments, ...)
    def create_weights(self, layer: Any, in_features: int, out_features: int, dtype) -> None:
        if layer.parallel.size > 1:
            raise ValueError(
                "packed GGUF weights run on one rank; use weights='bfloat16' or 'float32' with tensor_parallel_size > 1"
            )
        empty = nn.Parameter(torch.empty(0, dtype=torch.uint8), requires_grad=False)  # until loaded
        layer.weight = with_loader(empty, functools.partial(self.load_weight, layer))
        layer.gguf_shards, layer.segments, layer.compute_dtype = {}, [], dtype

    @staticmethod
    def load_weight(layer: Any, param, loaded, shard_id=None) -> None:
        if loaded.shape[1] != layer.in_features:
            raise ValueError(
                f"checkpoint tensor of shape {tuple(loaded.shape)} does not fit a layer of {layer.in_features} inputs"
            )
        layer.gguf_shards[shard_id] = loaded

    def process_weights_after_loading(self, layer: Any) -> None:
        shards = [layer.gguf_shards[key] for key in sorted(layer.gguf_shards, key=shard_position)]
        del layer.weight
        start = 0
        for index, run in enumerate(runs_of_one_kind(shards)):
            kind = run[0].kind if isinstance(run[0], PackedTensor) else "dense"
            data = torch.cat([s.data if kind != "dense" else s.to(layer.compute_dtype) for s in run])
            name = f"weight_{index}"
            layer.register_parameter(name, nn.Parameter(data, requires_grad=False))
            layer.segments.append(Segment(start, data.shape[0], kind, name))
            start += data.shape[0]
        if start != layer.out_features:
            raise ValueError(f"GGUF shards give {start} output features; the layer has {layer.out_features}")
        layer.gguf_shards = {}

    def apply(self, layer: Any, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        segments = layer.segments
        if len(segments) == 1:
            return segment_linear(layer, segments[0], x, bias)
        out = x.new_empty(x.shape[0], layer.out_features)
        for seg in segments:
            part = None if bias is None else bias[seg.start : seg.start + seg.rows]
            segment_linear(layer, seg, x, part, out[:, seg.start : seg.start + seg.rows])
        return out


def segment_linear(layer, seg: Segment, x, bias, out=None):
    weight = getattr(layer, seg.name)
    if seg.kind != "dense":
        return quant_cpu.linear(x, weight, seg.kind, layer.in_features, bias, out, decode_rows=STEP_DECODE_ROWS.get())
    result = nn.functional.linear(x, weight, bias)
    if out is None:
        return result
    out.copy_(result)
    return out


def row_invariant_rows(model: nn.Module) -> int | None:
    """The fewest activation rows at which one of the model's packed linears (its LM head included) leaves
    the integer kernel (quant_cpu.leaves_integer_at); below it every row comes out as it does alone.
    None: no packed linear changes path."""
    crossovers: list[int | None] = []
    for module in model.modules():
        if isinstance(module, LinearBase):
            packed = [seg.kind for seg in getattr(module, "segments", ()) if seg.kind != "dense"]
            crossovers += [quant_cpu.leaves_integer_at(kind, module.in_features) for kind in packed]
        elif isinstance(module, ParallelLMHead) and (kind := getattr(module.weight, "ggml_type", None)):
            crossovers.append(quant_cpu.leaves_integer_at(kind, module.hidden))
    return min((c for c in crossovers if c is not None), default=None)


def shard_position(shard_id) -> int:
    return SHARD_ORDER.get(shard_id, shard_id or 0)


def runs_of_one_kind(shards) -> list[list]:
    """Consecutive shards of one type (or all float) together: each run becomes one weight."""
    runs: list[list] = []
    for shard in shards:
        kind = shard.kind if isinstance(shard, PackedTensor) else "dense"
        last = runs[-1][0] if runs else None
        if last is not None and (last.kind if isinstance(last, PackedTensor) else "dense") == kind:
            runs[-1].append(shard)
        else:
            runs.append([shard])
    return runs
