"""CPU GEMMs through oneDNN with weights packed once at load.

torch's F.linear sends float32 to MKL, which on this machine (AMD EPYC with AVX-512) runs near
210 GFLOP/s; oneDNN with a weight pre-packed into its blocked layout runs the same shapes at
430-500 GFLOP/s (benchmarks/gemm.py measures both). bfloat16 already goes to oneDNN in torch, and
packing still saves the per-call reorder. The results are float32 GEMMs either way; only the
summation order differs.

Off with TESSERA_ONEDNN_LINEAR=0, and wherever torch lacks the mkldnn ops.
"""
from __future__ import annotations

import os

import torch

PACKED_DTYPES = (torch.float32, torch.bfloat16)


def enabled() -> bool:
    return (os.environ.get("TESSERA_ONEDNN_LINEAR", "1") != "0" and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_linear_pointwise") and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))


def can_pack(weight: torch.Tensor) -> bool:
    return weight.device.type == "cpu" and weight.dtype in PACKED_DTYPES and weight.dim() == 2 and enabled()


def pack(weight: torch.Tensor) -> torch.Tensor:
    """[out, in] dense weight -> an opaque oneDNN tensor of the same shape and dtype."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), None)


def linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
