"""Paged decode attention (Triton version of torch_ref.paged_decode_attention).

One query token per sequence, K/V read through the block table. Decode is memory bound, so the
kernel is organised around reading each K/V byte once:

- one program per (sequence, KV head, split): all G query heads sharing that KV head are
  processed together as the rows of a [BLOCK_G, D] tile (padded to >= 16 rows for tl.dot), so
  GQA never re-reads K/V;
- K/V tiles of BLOCK_N tokens are gathered through the block table one token row at a time,
  which works for any power-of-two block size, whether a tile spans several blocks or lies
  inside one;
- split-K: with few (sequence, KV head) pairs and long contexts the sequence is cut into
  NUM_SPLITS chunks handled by separate programs, each writing a partial output and its
  log-sum-exp; a second small kernel merges them. With NUM_SPLITS == 1 the first kernel writes
  the final output directly.

Only positions < seq_len are loaded (masks on the block-table read and on K/V), so padding
entries of the block table and unwritten slots are never touched. Softmax runs in base 2 with
the scale folded into log2(e).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

# First, before triton: decides between native CUDA and the interpreter (see _triton_utils).
from tessera_kernels import _triton_utils  # noqa: F401,I001
from tessera_kernels._triton_utils import check_last_dim_contiguous, next_pow2, num_sms, upcast_dot_inputs


@triton.jit
def _decode_split_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    out_ptr,
    part_out_ptr,
    part_lse_ptr,
    scale_log2,
    stride_qb,
    stride_qh,
    stride_cb,
    stride_ct,
    stride_ch,
    stride_bt,
    stride_ob,
    stride_oh,
    stride_pb,
    stride_ph,
    stride_ps,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    UPCAST: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    seq_len = tl.load(seq_lens_ptr + seq)
    # Per-sequence split length (a multiple of BLOCK_N so no tile straddles two splits): every
    # split of a sequence does the same amount of work whatever the other sequences' lengths.
    split_len = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = split * split_len
    end = tl.minimum(start + split_len, seq_len)

    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    heads = kv_head * GROUP + g
    g_mask = g < GROUP
    d_mask = d < HEAD_DIM
    q = tl.load(
        q_ptr + seq * stride_qb + heads[:, None] * stride_qh + d[None, :],
        mask=g_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    if UPCAST:
        q = q.to(tl.float32)
    else:
        q = q.to(k_cache_ptr.dtype.element_ty)  # tl.dot needs both operands in one dtype

    # Finite initial max: a row whose tiles are all masked then gives exp2(-inf - m) = 0, not NaN.
    m_i = tl.full([BLOCK_G], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    table_row = block_tables_ptr + seq * stride_bt
    head_off = kv_head * stride_ch
    for n0 in range(start, end, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        n_mask = pos < end
        # Only entries of blocks holding positions < seq_len are read.
        block = tl.load(table_row + pos // BLOCK_SIZE, mask=n_mask, other=0).to(tl.int64)
        row_off = block * stride_cb + (pos % BLOCK_SIZE) * stride_ct + head_off
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k = tl.load(k_cache_ptr + row_off[:, None] + d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_cache_ptr + row_off[:, None] + d[None, :], mask=kv_mask, other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale_log2  # [BLOCK_G, BLOCK_N]
        s = tl.where(n_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        m_i = m_new

    out_mask = g_mask[:, None] & d_mask[None, :]
    if NUM_SPLITS == 1:
        out = acc / l_i[:, None]
        tl.store(
            out_ptr + seq * stride_ob + heads[:, None] * stride_oh + d[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=out_mask,
        )
    else:
        # An empty split (short sequence) has l_i == 0: log-sum-exp -inf, weight 0 in the merge.
        has_keys = l_i > 0
        lse = tl.where(has_keys, m_i + tl.log2(tl.where(has_keys, l_i, 1.0)), float("-inf"))
        out = acc / tl.where(has_keys, l_i, 1.0)[:, None]
        part = seq * stride_pb + heads * stride_ph + split * stride_ps
        tl.store(part_out_ptr + part[:, None] * HEAD_DIM + d[None, :], out, mask=out_mask)
        tl.store(part_lse_ptr + part, lse, mask=g_mask)


@triton.jit
def _decode_merge_kernel(
    part_out_ptr,
    part_lse_ptr,
    out_ptr,
    stride_pb,
    stride_ph,
    stride_ob,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    s_mask = s < NUM_SPLITS
    d_mask = d < HEAD_DIM
    base = seq * stride_pb + head * stride_ph  # a head's splits are contiguous (stride_ps == 1)
    lse = tl.load(part_lse_ptr + base + s, mask=s_mask, other=float("-inf"))
    weight = tl.exp2(lse - tl.max(lse, axis=0))  # split 0 is never empty, so the max is finite
    part = tl.load(
        part_out_ptr + (base + s)[:, None] * HEAD_DIM + d[None, :], mask=s_mask[:, None] & d_mask[None, :], other=0.0
    )
    out = tl.sum(weight[:, None] * part, axis=0) / tl.sum(weight, axis=0)
    tl.store(out_ptr + seq * stride_ob + head * stride_oh + d, out.to(out_ptr.dtype.element_ty), mask=d_mask)


def pick_num_splits(batch: int, num_kv_heads: int, max_context: int, device: torch.device) -> int:
    """Split the sequence only when (sequence, KV head) programs alone cannot fill the GPU.

    Uses the block-table capacity as the context bound, so no device->host sync is needed.
    """
    sms = num_sms(device)
    programs = batch * num_kv_heads
    if programs >= 2 * sms or max_context <= 1024:
        return 1
    return max(1, min(triton.cdiv(2 * sms, programs), triton.cdiv(max_context, 512), 16))


def decode_meta(
    dtype: torch.dtype, group: int, head_dim: int, block_size: int, num_splits: int, block_n: int | None = None
) -> dict:
    """Compile-time parameters of the split kernel (shared with the sm_90 compile test)."""
    return dict(
        GROUP=group,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        BLOCK_G=max(16, next_pow2(group)),
        BLOCK_D=max(16, next_pow2(head_dim)),
        BLOCK_N=block_n or (32 if dtype == torch.float32 else 64),
        NUM_SPLITS=num_splits,
        UPCAST=upcast_dot_inputs(dtype),
        num_warps=4,
        num_stages=2,
    )


def paged_decode_attention(
    q, k_cache, v_cache, block_tables, seq_lens, scale, *, num_splits: int | None = None, block_n: int | None = None
):
    """One query token per sequence: q [B, Hq, D] -> out [B, Hq, D].

    num_splits / block_n override the heuristics (tests use them to cover every code path);
    block_n must be a power of two >= 16.
    """
    batch, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    assert block_size & (block_size - 1) == 0, "block size must be a power of two"
    assert num_heads % num_kv_heads == 0
    assert k_cache.stride() == v_cache.stride(), "k_cache and v_cache must share a layout"
    check_last_dim_contiguous(q, k_cache)
    group = num_heads // num_kv_heads
    out = torch.empty_like(q)
    if batch == 0:
        return out
    if num_splits is None:
        num_splits = pick_num_splits(batch, num_kv_heads, block_tables.shape[1] * block_size, q.device)
    meta = decode_meta(k_cache.dtype, group, head_dim, block_size, num_splits, block_n)
    if num_splits > 1:
        part_out = torch.empty(batch, num_heads, num_splits, head_dim, dtype=torch.float32, device=q.device)
        part_lse = torch.empty(batch, num_heads, num_splits, dtype=torch.float32, device=q.device)
    else:
        part_out = part_lse = out  # unused placeholders
    _decode_split_kernel[(batch, num_kv_heads, num_splits)](
        q,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        out,
        part_out,
        part_lse,
        scale * math.log2(math.e),
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        num_heads * num_splits,
        num_splits,
        1,
        **meta,
    )
    if num_splits > 1:
        _decode_merge_kernel[(batch, num_heads)](
            part_out,
            part_lse,
            out,
            num_heads * num_splits,
            num_splits,
            out.stride(0),
            out.stride(1),
            HEAD_DIM=head_dim,
            NUM_SPLITS=num_splits,
            BLOCK_S=next_pow2(num_splits),
            BLOCK_D=next_pow2(head_dim),
            num_warps=4 if head_dim >= 128 else 2,
        )
    return out
