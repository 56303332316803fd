"""Linear layers and row gathers on GGUF block-format weights, in C (csrc/quant_gemm.c).

A packed weight is the file's bytes, [rows, row_bytes] uint8, and its ggml type. The product
quantizes the activations to int8 per block of 32 values and runs integer dot products against
the weight's codes (AVX-512 VNNI, AVX2, or plain C); `reference_linear` is its meaning (the
weight dequantized by the gguf package, then a float matmul). The int8 activations make the
result differ from the reference by at most sum_i |w_i| * max|x| of i's block / 254 (half a step of
the activation's quantization), which the tests check per output.

KERNEL_TYPES have kernels; other ggml types are converted at load (inference/quantization/gguf.py).
"""
from __future__ import annotations

import numpy as np
import torch

from kernels import native_cpu

KERNEL_TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")


def type_number(name: str) -> int:
    from gguf import GGMLQuantizationType

    return int(GGMLQuantizationType[name])


def block_values(name: str) -> int:
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    return GGML_QUANT_SIZES[GGMLQuantizationType[name]][0]


def supports(x: torch.Tensor) -> bool:
    return x.device.type == "cpu" and x.dtype in native_cpu.SUPPORTED_DTYPES and native_cpu.load() is not None


def linear(x: torch.Tensor, packed: torch.Tensor, kind: str, in_features: int, bias: torch.Tensor | None = None,
           out: torch.Tensor | None = None, library=None) -> torch.Tensor:
    """x [m, in] @ W.T (+ bias) with W the [out, row_bytes] uint8 blocks of type `kind`; the result in
    x's dtype, written into `out` ([m, out] with unit column stride; a column slice is fine) when given."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    rows = packed.shape[0]
    out = x.new_empty(x.shape[0], rows) if out is None else out
    if bias is not None:
        bias = bias.to(x.dtype).contiguous()
    status = (library or native_cpu.load()).gguf_linear(
        x.data_ptr(), x.stride(0), x.shape[0], in_features, packed.data_ptr(), packed.shape[1], rows,
        type_number(kind), None if bias is None else bias.data_ptr(), out.data_ptr(), out.stride(0),
        native_cpu.SUPPORTED_DTYPES[x.dtype], torch.get_num_threads())
    _check(status, kind, in_features)
    return out


def dequantize_rows(packed: torch.Tensor, kind: str, ids: torch.Tensor, in_features: int, dtype=torch.float32,
                    library=None) -> torch.Tensor:
    """Rows `ids` of the packed weight, dequantized: [len(ids), in_features] in `dtype`."""
    ids = ids.reshape(-1).to(torch.int64).contiguous()
    out = torch.empty(ids.shape[0], in_features, dtype=dtype)
    status = (library or native_cpu.load()).gguf_dequantize_rows(
        packed.data_ptr(), packed.shape[1], packed.shape[0], type_number(kind), ids.data_ptr(), ids.shape[0],
        in_features, out.data_ptr(), native_cpu.SUPPORTED_DTYPES[dtype], torch.get_num_threads())
    _check(status, kind, in_features)
    return out


def _check(status: int, kind: str, in_features: int) -> None:
    if status == -1:
        raise ValueError(f"no packed kernel for {kind} rows of {in_features} values")
    if status == -2:
        raise MemoryError("the packed GGUF kernel could not allocate its scratch memory")
    if status == -3:
        raise IndexError("a row id is outside the packed table")


def reference_linear(x: torch.Tensor, packed: torch.Tensor, kind: str, bias: torch.Tensor | None = None):
    """The meaning of `linear`: the gguf package's dequantization, then a float32 matmul."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    weight = torch.from_numpy(np.ascontiguousarray(dequantize(packed.numpy(), GGMLQuantizationType[kind])))
    out = x.float() @ weight.float().T
    return out if bias is None else out + bias.float()
