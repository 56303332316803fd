"""Paged prefill / extend attention over a ragged batch (Triton version of
torch_ref.paged_prefill_attention).

Each sequence's new tokens (query_start_loc) attend causally to its cached prefix and to
themselves, all read through the block table (the new tokens' K/V are stored first), which is
what prefix caching and chunked prefill need. Flash-attention style: one program per
(query tile of BLOCK_M tokens of one sequence, query head) streams K/V tiles of BLOCK_N
positions with an online softmax in base 2. GQA maps query head h to KV head h // G.

The ragged batch is flattened into tiles without a device->host sync: the launcher computes
the cumulative tile count per sequence on the device, launches an upper bound of
cdiv(T, BLOCK_M) + num_seqs tiles, and each program binary-searches its sequence; surplus
programs exit at once.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

# First, before triton: decides between native CUDA and the interpreter (see _triton_utils).
from tessera_kernels import _triton_utils  # noqa: F401,I001
from tessera_kernels._triton_utils import check_last_dim_contiguous, next_pow2, upcast_dot_inputs


@triton.jit
def _find_sequence(cu_tiles_ptr, num_seqs, tile):
    """Largest i with cu_tiles[i] <= tile (cu_tiles is non-decreasing, cu_tiles[0] == 0)."""
    lo = tile * 0  # tensors from the start: loop-carried values must keep one type
    hi = lo + num_seqs - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if tl.load(cu_tiles_ptr + mid) <= tile:
            lo = mid
        else:
            hi = mid - 1
    return lo


@triton.jit(do_not_specialize=["num_seqs"])
def _prefill_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    block_tables_ptr,
    query_start_loc_ptr,
    seq_lens_ptr,
    cu_tiles_ptr,
    scale_log2,
    num_seqs,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_cb,
    stride_ct,
    stride_ch,
    stride_bt,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    UPCAST: tl.constexpr,
):
    tile = tl.program_id(0)
    head = tl.program_id(1)
    if tile >= tl.load(cu_tiles_ptr + num_seqs):  # surplus program of the upper-bound grid
        return
    seq = _find_sequence(cu_tiles_ptr, num_seqs, tile)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + seq)
    ctx_len = seq_len - q_len  # cached prefix in front of this step's tokens
    m0 = (tile - tl.load(cu_tiles_ptr + seq)) * BLOCK_M  # first query row of the tile in the sequence

    rows = m0 + tl.arange(0, BLOCK_M)
    row_mask = rows < q_len
    q_pos = ctx_len + rows  # absolute positions of the tile's queries
    d = tl.arange(0, BLOCK_D)
    d_mask = d < HEAD_DIM
    tokens = (q_start + rows).to(tl.int64)
    q = tl.load(
        q_ptr + tokens[:, None] * stride_qt + head * stride_qh + d[None, :],
        mask=row_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    if UPCAST:
        q = q.to(tl.float32)
    else:
        q = q.to(k_cache_ptr.dtype.element_ty)  # tl.dot needs both operands in one dtype

    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)  # finite: fully masked rows stay NaN-free
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    table_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    head_off = (head // GROUP) * stride_ch
    # Keys up to the tile's last query position; this never exceeds seq_len, so block-table
    # entries past the sequence's used length are never read.
    kv_end = ctx_len + tl.minimum(m0 + BLOCK_M, q_len)
    for n0 in range(0, kv_end, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        n_mask = pos < kv_end
        block = tl.load(table_row + pos // BLOCK_SIZE, mask=n_mask, other=0).to(tl.int64)
        row_off = block * stride_cb + (pos % BLOCK_SIZE) * stride_ct + head_off
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k = tl.load(k_cache_ptr + row_off[:, None] + d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_cache_ptr + row_off[:, None] + d[None, :], mask=kv_mask, other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale_log2  # [BLOCK_M, BLOCK_N]
        causal = (pos[None, :] <= q_pos[:, None]) & n_mask[None, :]
        s = tl.where(causal, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        m_i = m_new

    # Every real query row sees at least key 0, so l_i > 0 there; padding rows are not stored.
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(
        out_ptr + tokens[:, None] * stride_ot + head * stride_oh + d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=row_mask[:, None] & d_mask[None, :],
    )


def prefill_meta(
    dtype: torch.dtype,
    group: int,
    head_dim: int,
    block_size: int,
    block_m: int | None = None,
    block_n: int | None = None,
) -> dict:
    """Compile-time parameters of the launch (shared with the sm_90 compile test)."""
    wide = dtype == torch.float32 or head_dim > 128  # keep fp32 / large-head tiles inside shared memory
    return dict(
        GROUP=group,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        BLOCK_M=block_m or (64 if wide else 128),
        BLOCK_N=block_n or (32 if wide else 64),
        BLOCK_D=max(16, next_pow2(head_dim)),
        UPCAST=upcast_dot_inputs(dtype),
        num_warps=4 if wide else 8,
        num_stages=2,
    )


def paged_prefill_attention(
    q,
    k_cache,
    v_cache,
    block_tables,
    query_start_loc,
    seq_lens,
    scale,
    *,
    block_m: int | None = None,
    block_n: int | None = None,
):
    """Ragged batch of new tokens: q [T, Hq, D] -> out [T, Hq, D].

    The new tokens' K/V must already be in the cache (store_kv_cache first). block_m / block_n
    override the tile sizes (powers of two >= 16; tests use them to cover multi-tile paths).
    """
    num_tokens, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    assert block_size & (block_size - 1) == 0, "block size must be a power of two"
    assert num_heads % num_kv_heads == 0
    assert k_cache.stride() == v_cache.stride(), "k_cache and v_cache must share a layout"
    check_last_dim_contiguous(q, k_cache)
    num_seqs = seq_lens.shape[0]
    out = torch.empty_like(q)
    if num_tokens == 0 or num_seqs == 0:
        return out
    meta = prefill_meta(k_cache.dtype, num_heads // num_kv_heads, head_dim, block_size, block_m, block_n)
    # Tiles per sequence and their running total, on the device (no sync).
    q_lens = (query_start_loc[1:] - query_start_loc[:-1]).to(torch.int32)
    cu_tiles = torch.zeros(num_seqs + 1, dtype=torch.int32, device=q.device)
    torch.cumsum(triton.cdiv(q_lens, meta["BLOCK_M"]), 0, dtype=torch.int32, out=cu_tiles[1:])
    max_tiles = triton.cdiv(num_tokens, meta["BLOCK_M"]) + num_seqs
    _prefill_kernel[(max_tiles, num_heads)](
        q,
        k_cache,
        v_cache,
        out,
        block_tables,
        query_start_loc,
        seq_lens,
        cu_tiles,
        scale * math.log2(math.e),
        num_seqs,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        block_tables.stride(0),
        **meta,
    )
    return out
