"""Write new tokens' K/V into the paged cache (Triton version of torch_ref.store_kv_cache).

One program per token copies all of its KV heads: slot -> (block, offset) is computed once per
token, and a slot of -1 (padding token) returns before touching memory.
"""

from __future__ import annotations

import triton
import triton.language as tl

# First, before triton: decides between native CUDA and the interpreter (see _triton_utils).
from tessera_kernels import _triton_utils  # noqa: F401,I001
from tessera_kernels._triton_utils import check_last_dim_contiguous, next_pow2


@triton.jit
def _store_kv_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cb,
    stride_ct,
    stride_ch,
    num_kv_heads,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot < 0:  # padding token: nothing to store
        return
    # BLOCK_SIZE is a constexpr power of two, so these compile to a shift and a mask.
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    mask = (h < num_kv_heads) & (d < HEAD_DIM)  # heads/head_dim padded up to powers of two
    dst = block * stride_cb + offset * stride_ct + h * stride_ch + d
    k = tl.load(k_ptr + token * stride_kt + h * stride_kh + d, mask=mask)
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    v = tl.load(v_ptr + token * stride_vt + h * stride_vh + d, mask=mask)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def store_kv_cache(k, v, k_cache, v_cache, slot_mapping) -> None:
    """Write k, v ([T, Hkv, D]) into the paged caches at slot_mapping ([T]); -1 skips."""
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    block_size = k_cache.shape[1]
    assert block_size & (block_size - 1) == 0, "block size must be a power of two"
    assert k_cache.stride() == v_cache.stride(), "k_cache and v_cache must share a layout"
    # k/v are often column slices of a fused qkv projection: any token/head stride is fine.
    check_last_dim_contiguous(k, v, k_cache)
    _store_kv_kernel[(num_tokens,)](
        k,
        v,
        k_cache,
        v_cache,
        slot_mapping,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        num_kv_heads,
        **store_kv_meta(num_kv_heads, head_dim, block_size),
    )


def store_kv_meta(num_kv_heads: int, head_dim: int, block_size: int) -> dict:
    """Compile-time parameters of the launch (shared with the sm_90 compile test)."""
    return dict(
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        BLOCK_H=next_pow2(num_kv_heads),
        BLOCK_D=next_pow2(head_dim),
        num_warps=4 if num_kv_heads * head_dim >= 1024 else 1,
    )
