"""Pure-torch references for the quantized linear layers (what the CPU runs, what the tests trust).

Layouts (the formats' own, as AutoGPTQ and AutoAWQ write them; K = in features, N = out features,
G = number of quantization groups):

- GPTQ: qweight int32 [K/8, N], 8 int4 along K per element (nibble j of row r = input 8r + j);
  qzeros int32 [G, N/8], 8 int4 along N (nibble j = output 8c + j), stored as zero - 1 in the
  "gptq" (v1) checkpoint format, hence `zero_offset=1`; scales [G, N]; g_idx int32 [K], the group
  of every input row (act-order / desc_act checkpoints permute it).
- AWQ (GEMM version): qweight int32 [K, N/8] and qzeros int32 [G, N/8], 8 int4 along N in the
  interleaved order AWQ_PACK_ORDER (nibble j holds output 8c + AWQ_PACK_ORDER[j]); scales [G, N];
  the group of input k is k // group_size; zeros are stored as they are.
- int8: weight int8 [N, K] and one scale per output channel, w = q * scale[n].

w[k, n] = (q[k, n] - zero[g(k), n]) * scale[g(k), n], and y = x @ w.
"""

from __future__ import annotations

import torch

PACK = 8  # int4 values per int32
AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
AWQ_UNPACK_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)  # nibble that holds output column j of a pack
_SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)


# ---- unpacking ----------------------------------------------------------------------------------


def unpack_int4_rows(packed: torch.Tensor) -> torch.Tensor:
    """[R/8, C] int32 -> [R, C] values in 0..15 (nibble j of row r is row 8r + j)."""
    values = (packed.unsqueeze(1) >> _SHIFTS.to(packed.device)[None, :, None]) & 0xF
    return values.reshape(-1, packed.shape[1])


def unpack_int4_cols(packed: torch.Tensor, order=None) -> torch.Tensor:
    """[R, C/8] int32 -> [R, C] values in 0..15; `order` maps column j of a pack to its nibble."""
    values = (packed.unsqueeze(2) >> _SHIFTS.to(packed.device)[None, None, :]) & 0xF
    if order is not None:
        values = values[:, :, list(order)]
    return values.reshape(packed.shape[0], -1)


# ---- dequantization -----------------------------------------------------------------------------


def gptq_dequantize(qweight, qzeros, scales, g_idx, zero_offset: int = 1) -> torch.Tensor:
    """GPTQ tensors -> float weight [K, N] in the dtype of scales."""
    g = g_idx.long()
    q = unpack_int4_rows(qweight)
    zeros = unpack_int4_cols(qzeros) + zero_offset
    return (q - zeros[g]).to(scales.dtype) * scales[g]


def awq_dequantize(qweight, qzeros, scales, group_size: int) -> torch.Tensor:
    """AWQ (GEMM) tensors -> float weight [K, N] in the dtype of scales."""
    g = torch.arange(qweight.shape[0], device=qweight.device) // group_size
    q = unpack_int4_cols(qweight, AWQ_UNPACK_ORDER)
    zeros = unpack_int4_cols(qzeros, AWQ_UNPACK_ORDER)
    return (q - zeros[g]).to(scales.dtype) * scales[g]


def gptq_linear(x, qweight, qzeros, scales, g_idx, bias=None, zero_offset: int = 1):
    """y = x @ dequant(W) (+ bias): the CPU path, one dequantized weight alive at a time."""
    out = x @ gptq_dequantize(qweight, qzeros, scales.to(x.dtype), g_idx, zero_offset)
    return out if bias is None else out + bias


def awq_linear(x, qweight, qzeros, scales, group_size: int, bias=None):
    out = x @ awq_dequantize(qweight, qzeros, scales.to(x.dtype), group_size)
    return out if bias is None else out + bias


def int8_linear(x, weight, scale, bias=None):
    """Weight-only int8: the per-channel scale is applied to the product, not to the weight."""
    out = torch.nn.functional.linear(x, weight.to(x.dtype)) * scale.to(x.dtype)
    return out if bias is None else out + bias


# ---- quantization (round to nearest) and packing --------------------------------------------------


def quantize_int8_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] float -> (int8 [N, K], float32 scale [N]), symmetric absmax per output channel."""
    w = weight.float()
    scale = w.abs().amax(dim=1).clamp(min=1e-8) / 127.0
    q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return q, scale


def quantize_int4_groups(weight_kn: torch.Tensor, g_idx: torch.Tensor, num_groups: int, sym: bool = False):
    """[K, N] float -> (q [K, N] in 0..15, zeros [G, N] in 0..15, scales [G, N]) per group.

    sym: zero fixed at 8 and the range symmetric (GPTQ's default, sym=True); else min/max (AWQ).
    """
    w = weight_kn.float()
    g = g_idx.long()
    n = w.shape[1]
    rows = g[:, None].expand_as(w)
    lo = torch.full((num_groups, n), float("inf")).scatter_reduce(0, rows, w, "amin")
    hi = torch.full((num_groups, n), float("-inf")).scatter_reduce(0, rows, w, "amax")
    lo, hi = lo.clamp(max=0), hi.clamp(min=0)  # zero stays representable
    if sym:
        scales = (torch.maximum(-lo, hi) * 2 / 15).clamp(min=1e-8)
        zeros = torch.full_like(scales, 8.0)
    else:
        scales = ((hi - lo) / 15).clamp(min=1e-8)
        zeros = torch.round(-lo / scales).clamp(0, 15)
    q = torch.round(w / scales[g] + zeros[g]).clamp(0, 15)
    return q.to(torch.int32), zeros.to(torch.int32), scales


def pack_int4_rows(values: torch.Tensor) -> torch.Tensor:
    """[R, C] 0..15 -> [R/8, C] int32, the inverse of unpack_int4_rows."""
    v = values.to(torch.int64).reshape(-1, PACK, values.shape[1])
    packed = (v << _SHIFTS.to(torch.int64)[None, :, None]).sum(dim=1)
    return _to_int32(packed)


def pack_int4_cols(values: torch.Tensor, order=None) -> torch.Tensor:
    """[R, C] 0..15 -> [R, C/8] int32; nibble j holds column order[j] of each pack of 8."""
    v = values.to(torch.int64).reshape(values.shape[0], -1, PACK)
    if order is not None:
        v = v[:, :, list(order)]
    packed = (v << _SHIFTS.to(torch.int64)[None, None, :]).sum(dim=2)
    return _to_int32(packed)


def _to_int32(packed: torch.Tensor) -> torch.Tensor:
    """uint32 bit patterns held in int64 -> the same bits as int32 (wrap the sign bit)."""
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)


def act_order_g_idx(num_inputs: int, group_size: int, seed: int = 0) -> torch.Tensor:
    """A desc_act-style g_idx: groups of group_size inputs in a random (activation) order."""
    perm = torch.randperm(num_inputs, generator=torch.Generator().manual_seed(seed))
    g_idx = torch.empty(num_inputs, dtype=torch.int32)
    g_idx[perm] = (torch.arange(num_inputs) // group_size).to(torch.int32)
    return g_idx


def gptq_pack(weight_nk: torch.Tensor, group_size: int, g_idx: torch.Tensor | None = None) -> dict:
    """Round-to-nearest GPTQ (v1 format) tensors of an [N, K] float weight."""
    k = weight_nk.shape[1]
    group_size = k if group_size == -1 else group_size
    if g_idx is None:
        g_idx = (torch.arange(k) // group_size).to(torch.int32)
    # sym: zeros are 8, stored as 7 (v1's "zero - 1"), which the kernels add back.
    q, zeros, scales = quantize_int4_groups(weight_nk.t(), g_idx, -(-k // group_size), sym=True)
    return {
        "qweight": pack_int4_rows(q),
        "qzeros": pack_int4_cols(zeros - 1),
        "scales": scales.to(torch.float16),
        "g_idx": g_idx,
    }


def awq_pack(weight_nk: torch.Tensor, group_size: int) -> dict:
    """Round-to-nearest AWQ (GEMM) tensors of an [N, K] float weight."""
    k = weight_nk.shape[1]
    g_idx = torch.arange(k) // group_size
    q, zeros, scales = quantize_int4_groups(weight_nk.t(), g_idx, -(-k // group_size))
    return {
        "qweight": pack_int4_cols(q, AWQ_PACK_ORDER),
        "qzeros": pack_int4_cols(zeros, AWQ_PACK_ORDER),
        "scales": scales.to(torch.float16),
    }
