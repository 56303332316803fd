"""Neox-style rotary embedding, in place on q and k (Triton version of torch_ref.rotary_embedding).

One program per token: the token's cos/sin row is loaded once and applied to all its query and
key heads. q and k may be strided views (slices of a fused qkv tensor); they are updated in place.
Any llama3 frequency scaling is already baked into cos_sin_cache ([max_pos, D] = cos | sin).
"""

from __future__ import annotations

import triton
import triton.language as tl

# First, before triton: decides between native CUDA and the interpreter (see _triton_utils).
from tessera_kernels import _triton_utils  # noqa: F401,I001
from tessera_kernels._triton_utils import check_last_dim_contiguous, next_pow2


@triton.jit
def _rotate_heads(
    base_ptr, stride_h, num_heads, cos, sin, HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr
):
    h = tl.arange(0, BLOCK_H)[:, None]
    i = tl.arange(0, BLOCK_HALF)[None, :]
    mask = (h < num_heads) & (i < HALF)
    p1 = base_ptr + h * stride_h + i
    p2 = p1 + HALF
    x1 = tl.load(p1, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(p2, mask=mask, other=0.0).to(tl.float32)
    # Both halves are read before either is written, so the in-place update is safe.
    tl.store(p1, (x1 * cos - x2 * sin).to(base_ptr.dtype.element_ty), mask=mask)
    tl.store(p2, (x2 * cos + x1 * sin).to(base_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_kernel(
    pos_ptr,
    q_ptr,
    k_ptr,
    cos_sin_ptr,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_cs,
    num_q_heads,
    num_kv_heads,
    max_position,
    HALF: tl.constexpr,
    BLOCK_HQ: tl.constexpr,
    BLOCK_HK: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + token).to(tl.int64)
    i = tl.arange(0, BLOCK_HALF)[None, :]
    # An out-of-range position must not read outside the cache (the reference would raise);
    # it yields cos = sin = 0 instead. (pos is broadcast first: the interpreter mishandles
    # scalar & block boolean ops.)
    pos_b = pos + tl.zeros([1, BLOCK_HALF], tl.int64)
    cs_mask = (i < HALF) & (pos_b >= 0) & (pos_b < max_position)
    cos = tl.load(cos_sin_ptr + pos * stride_cs + i, mask=cs_mask, other=0.0).to(tl.float32)
    sin = tl.load(cos_sin_ptr + pos * stride_cs + HALF + i, mask=cs_mask, other=0.0).to(tl.float32)
    _rotate_heads(q_ptr + token * stride_qt, stride_qh, num_q_heads, cos, sin, HALF, BLOCK_HQ, BLOCK_HALF)
    _rotate_heads(k_ptr + token * stride_kt, stride_kh, num_kv_heads, cos, sin, HALF, BLOCK_HK, BLOCK_HALF)


def rotary_meta(num_q_heads: int, num_kv_heads: int, head_dim: int) -> dict:
    """Compile-time parameters of the launch (shared with the sm_90 compile test)."""
    half = head_dim // 2
    return dict(
        HALF=half,
        BLOCK_HQ=next_pow2(num_q_heads),
        BLOCK_HK=next_pow2(num_kv_heads),
        BLOCK_HALF=next_pow2(half),
        num_warps=4 if num_q_heads * half >= 2048 else 1,
    )


def rotary_embedding(positions, q, k, cos_sin_cache) -> None:
    """Neox-style rotary applied in place to q [T, Hq, D] and k [T, Hkv, D].

    cos_sin_cache: [max_position, D] holding cos in the first D/2 columns and sin in the rest
    (llama3 frequency scaling, when used, is already baked into the cache).
    """
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    if cos_sin_cache.shape[-1] != head_dim or k.shape[2] != head_dim:
        raise ValueError("rotary_embedding rotates whole heads: cos_sin_cache width must equal head_dim")
    if num_tokens == 0:
        return
    check_last_dim_contiguous(q, k, cos_sin_cache)
    _rotary_kernel[(num_tokens,)](
        positions,
        q,
        k,
        cos_sin_cache,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        cos_sin_cache.stride(0),
        num_q_heads,
        num_kv_heads,
        cos_sin_cache.shape[0],
        **rotary_meta(num_q_heads, num_kv_heads, head_dim),
    )
