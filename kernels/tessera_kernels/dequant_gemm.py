"""int4 dequantize-GEMM: y = x @ dequant(W) for GPTQ and AWQ weights (kernels/tessera_kernels/quant_ref.py is the
reference and documents the layouts).

One program computes a [BLOCK_M, BLOCK_N] tile of y, walking K in BLOCK_K steps: it loads the
packed int32 words of the weight tile, shifts out the nibbles, subtracts the zero and multiplies
by the scale of each row's group (looked up through g_idx, so act-order GPTQ needs no reordering),
then feeds the float tile to tl.dot. The full-precision weight never exists in memory.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# First, before triton: decides between native CUDA and the interpreter (see _triton_utils).
from tessera_kernels import _triton_utils  # noqa: F401,I001
from tessera_kernels._triton_utils import upcast_dot_inputs

LAYOUTS = ("gptq", "awq")


@triton.jit
def _dequant_gemm_kernel(
    x_ptr,
    qweight_ptr,
    qzeros_ptr,
    scales_ptr,
    g_idx_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_om,
    AWQ: tl.constexpr,
    ZERO_OFFSET: tl.constexpr,
    UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = rows < M
    n_mask = cols < N
    pack_cols = N // 8
    if AWQ:
        # Column j of a pack of 8 sits in nibble (0, 4, 1, 5, 2, 6, 3, 7)[j].
        col_shift = ((cols % 8) // 2 + (cols % 2) * 4) * 4
    else:
        col_shift = (cols % 8) * 4
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < K
        w_mask = k_mask[:, None] & n_mask[None, :]
        x = tl.load(
            x_ptr + rows[:, None].to(tl.int64) * stride_xm + ks[None, :],
            mask=m_mask[:, None] & k_mask[None, :],
            other=0.0,
        )
        if AWQ:
            packed = tl.load(qweight_ptr + ks[:, None] * pack_cols + (cols // 8)[None, :], mask=w_mask, other=0)
            q = (packed >> col_shift[None, :]) & 0xF
        else:
            packed = tl.load(qweight_ptr + (ks // 8)[:, None] * N + cols[None, :], mask=w_mask, other=0)
            q = (packed >> ((ks % 8) * 4)[:, None]) & 0xF
        groups = tl.load(g_idx_ptr + ks, mask=k_mask, other=0)
        zword = tl.load(qzeros_ptr + groups[:, None] * pack_cols + (cols // 8)[None, :], mask=w_mask, other=0)
        zeros = ((zword >> col_shift[None, :]) & 0xF) + ZERO_OFFSET
        scales = tl.load(scales_ptr + groups[:, None] * N + cols[None, :], mask=w_mask, other=0.0)
        w = (q - zeros).to(tl.float32) * scales.to(tl.float32)
        if UPCAST:
            acc += tl.dot(x.to(tl.float32), w, input_precision="ieee")
        else:
            acc += tl.dot(x, w.to(x.dtype))
    tl.store(
        out_ptr + rows[:, None].to(tl.int64) * stride_om + cols[None, :],
        acc.to(out_ptr.dtype.element_ty),
        mask=m_mask[:, None] & n_mask[None, :],
    )


def dequant_gemm_meta(m: int, n: int) -> dict:
    """Tile sizes: tl.dot needs every dimension >= 16; decode batches are short in M."""
    block_m = 16 if m <= 16 else 32 if m <= 32 else 64
    block_n = 64 if n >= 64 else 32 if n >= 32 else 16
    return dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=32, num_warps=4)


def dequant_gemm(x, qweight, qzeros, scales, g_idx, layout: str, zero_offset: int = 0, bias=None):
    """x [..., K] -> [..., N] with int4 weights in `layout` ("gptq" or "awq").

    g_idx: int32 [K], the group of every input row (for AWQ simply k // group_size).
    zero_offset: 1 for GPTQ's v1 checkpoints (zeros stored minus one), else 0.
    """
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    k, n = g_idx.shape[0], scales.shape[1]
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty(x2.shape[0], n, dtype=x.dtype, device=x.device)
    m = x2.shape[0]
    if m:
        meta = dequant_gemm_meta(m, n)
        grid = (triton.cdiv(m, meta["BLOCK_M"]), triton.cdiv(n, meta["BLOCK_N"]))
        _dequant_gemm_kernel[grid](
            x2,
            qweight,
            qzeros,
            scales,
            g_idx,
            out,
            m,
            n,
            k,
            x2.stride(0),
            out.stride(0),
            AWQ=layout == "awq",
            ZERO_OFFSET=zero_offset,
            UPCAST=upcast_dot_inputs(x.dtype),
            **meta,
        )
    out = out.reshape(*x.shape[:-1], n)
    return out if bias is None else out + bias
