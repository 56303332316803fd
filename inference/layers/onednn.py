"""CPU GEMMs through oneDNN with weights packed once at load.

torch's nn.functional.linear sends float32 to MKL; oneDNN with a weight pre-packed into its blocked
layout runs the same shapes about twice as fast (benchmarks/gemm.py measures both; the figures are in
docs/kernels.md). bfloat16 already goes to oneDNN in torch, and
packing still saves the per-call reorder. The results are float32 GEMMs either way; only the
summation order differs.

Off with TESSERA_ONEDNN_LINEAR=0, and wherever torch lacks the mkldnn ops.
"""

from __future__ import annotations

import os

import torch

PACKED_DTYPES = (torch.float32, torch.bfloat16)


def enabled() -> bool:
    return (
        os.environ.get("TESSERA_ONEDNN_LINEAR", "1") != "0"
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    )


def can_pack(weight: torch.Tensor) -> bool:
    return weight.device.type == "cpu" and weight.dtype in PACKED_DTYPES and weight.dim() == 2 and enabled()


def pack(weight: torch.Tensor) -> torch.Tensor:
    """[out, in] dense weight -> an opaque oneDNN tensor of the same shape and dtype."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), None)


def padded_rows(rows: int) -> int:
    """The row count a GEMM runs at: exact up to 16, then rounded up to 8 steps per power of two.

    oneDNN builds one primitive per input shape and keeps 1024 of them. A server sees every token
    count from 1 to max_num_batched_tokens, for each of the model's GEMM shapes, so with exact
    shapes the cache thrashes: the four GEMMs of the bench model over 600 row counts in random
    order took 3.2 s a pass with exact shapes and 2.4 s rounded (benchmarks/gemm.py). Rounding
    leaves 72 row counts up to 2048, for at most 12.5% extra rows.
    """
    if rows <= 16:
        return rows
    step = 1 << (rows - 1).bit_length() - 4  # an eighth of the power of two at or above rows
    return -(-rows // step) * step


def row_counts(max_rows: int) -> list[int]:
    """Every row count padded_rows gives for 1..max_rows rows (72 up to 2048)."""
    return sorted({padded_rows(rows) for rows in range(1, max_rows + 1)})


def warm_up(gemms) -> None:
    """Build oneDNN's primitive of every GEMM shape a model will run, now, at start-up.

    gemms: (packed weight, bias or None, most rows) per linear layer. The first call of a shape
    builds its primitive (docs/kernels.md has the cost). Without this a server pays it on requests, 4 GEMM
    shapes a layer on the first prompt of each padded length, which showed in its TTFT. Primitives
    are cached by shape, not by weight, so one layer of each shape is enough.
    """
    seen = set()
    for packed, bias, max_rows in gemms:
        for rows in row_counts(max_rows):
            key = (tuple(packed.shape), packed.dtype, bias is not None, rows)
            if key not in seen:
                seen.add(key)
                linear(torch.zeros(rows, packed.shape[1], dtype=packed.dtype), packed, bias)


def empty_rows(rows: int, *tail: int, like: torch.Tensor) -> torch.Tensor:
    """An uninitialised [rows, *tail] tensor whose storage has room for padded_rows(rows) rows (the
    extra ones zero): a GEMM reads it at the padded row count in place (linear) instead of copying
    it into a padded tensor. The elementwise and attention kernels write their outputs into these
    (what the copies cost: docs/kernels.md)."""
    padded = padded_rows(rows)
    if padded == rows:  # every step of up to 16 tokens: no slicing on the decode hot path
        return like.new_empty(rows, *tail)
    full = like.new_empty(padded, *tail)
    full[rows:].zero_()
    return full[:rows]


def at_rows(x: torch.Tensor, padded: int) -> torch.Tensor:
    """x [rows, in] read as [padded, in]: in place when its storage has the room (empty_rows), else a
    zero-padded copy. Whatever the extra rows hold only reaches output rows that are dropped."""
    rows, cols = x.shape
    if padded == rows:
        return x
    if (
        x.is_contiguous()
        and x.storage_offset() == 0
        and x.untyped_storage().nbytes() >= padded * cols * x.element_size()
    ):
        return x.as_strided((padded, cols), (cols, 1))
    return torch.nn.functional.pad(x, (0, 0, 0, padded - rows))


def linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [rows, in] @ packed.T (+ bias), computed at padded_rows(rows) rows."""
    rows = x.shape[0]
    padded = padded_rows(rows)
    out = torch.ops.mkldnn._linear_pointwise(at_rows(x, padded), packed, bias, "none", [], "")
    return out[:rows] if padded != rows else out
