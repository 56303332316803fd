"""Pure-torch references for every kernel in this package.

Each function defines the meaning of the Triton kernel of the same name and is what the engine
runs on CPU, so they are vectorised (no per-token Python loops) rather than naive.

Shared layouts:
- k_cache / v_cache: [num_blocks, block_size, num_kv_heads, head_dim] (one pair per layer).
- slot = block_id * block_size + offset_in_block; slot -1 means "skip this token".
- block_tables: int32 [num_seqs, max_blocks_per_seq]; entries past a sequence's used length
  are padding and must never be read.
- query_start_loc: int32 [num_seqs + 1], cumulative count of new (query) tokens per sequence.
- seq_lens: int32 [num_seqs], context length of each sequence after this step's tokens are added.
  Query token j of sequence i sits at position seq_lens[i] - query_len_i + j and attends causally
  to every position <= its own.
"""

from __future__ import annotations

import threading

import torch
import torch.nn.functional as F

_scratch = threading.local()


def workspace(name: str, shape, dtype, device) -> torch.Tensor:
    """A reusable per-thread scratch tensor for the K/V gathers.

    A fresh allocation of this size is mmapped and page-faults on first touch; on CPU that cost
    more than the copy itself (docs/kernels.md, Measurements behind code comments).
    """
    buffers = _scratch.__dict__.setdefault("buffers", {})
    numel = 1
    for n in shape:
        numel *= n
    key = (name, dtype, str(device))
    buf = buffers.get(key)
    if buf is None or buf.numel() < numel:
        with torch.inference_mode(False):  # a normal tensor, writable in and out of inference mode
            buf = buffers[key] = torch.empty(numel, dtype=dtype, device=device)
    return buf[:numel].view(shape)


def store_kv_cache(k, v, k_cache, v_cache, slot_mapping) -> None:
    """Write k, v ([T, Hkv, D]) into the paged caches at slot_mapping ([T]); -1 skips."""
    keep = slot_mapping >= 0
    if not bool(keep.all()):
        k, v, slot_mapping = k[keep], v[keep], slot_mapping[keep]
    flat_k = k_cache.view(-1, *k_cache.shape[2:])
    flat_v = v_cache.view(-1, *v_cache.shape[2:])
    flat_k.index_copy_(0, slot_mapping, k.to(flat_k.dtype))
    flat_v.index_copy_(0, slot_mapping, v.to(flat_v.dtype))


def gather_kv(k_cache, v_cache, block_table_row, length):
    """K and V of one sequence's first `length` positions, as [length, Hkv, D]."""
    block_size = k_cache.shape[1]
    num_blocks = (length + block_size - 1) // block_size
    blocks = block_table_row[:num_blocks].long()
    k = k_cache[blocks].reshape(-1, *k_cache.shape[2:])[:length]
    v = v_cache[blocks].reshape(-1, *v_cache.shape[2:])[:length]
    return k, v


def paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale):
    """One query token per sequence: q [B, Hq, D] -> out [B, Hq, D].

    Large batches are sorted by length and run in groups of similar lengths, which cuts the
    padding that the gathered batch carries (docs/kernels.md, Measurements behind code comments).
    """
    num_groups = min(16, q.shape[0] // 16)
    if num_groups < 2:
        return decode_padded(q, k_cache, v_cache, block_tables, seq_lens, scale)
    out = torch.empty_like(q)
    for rows in torch.argsort(seq_lens).tensor_split(num_groups):
        out[rows] = decode_padded(q[rows], k_cache, v_cache, block_tables[rows], seq_lens[rows], scale)
    return out


def decode_padded(q, k_cache, v_cache, block_tables, seq_lens, scale):
    """paged_decode_attention over one padded batch.

    K/V are gathered slot by slot into a padded [B, Hkv, L, D] batch; query heads are grouped
    per KV head ([B, Hkv, G, D]) so GQA needs no repeated K/V. Padding positions re-read the
    sequence's own position 0 (always written, so finite) and are masked out of the softmax:
    no block-table entry past a sequence's used length is ever followed.
    """
    batch, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    max_len = int(seq_lens.max())
    positions = torch.arange(max_len, device=block_tables.device)
    valid = positions[None, :] < seq_lens.to(block_tables.device)[:, None]  # [B, L]
    block_index = torch.where(valid, positions // block_size, 0)
    slots = block_tables.long().gather(1, block_index) * block_size + torch.where(valid, positions % block_size, 0)
    shape = (batch, max_len, num_kv_heads, head_dim)
    k = torch.index_select(
        k_cache.view(-1, num_kv_heads, head_dim),
        0,
        slots.flatten(),
        out=workspace("k", shape, k_cache.dtype, k_cache.device).view(-1, num_kv_heads, head_dim),
    )
    v = torch.index_select(
        v_cache.view(-1, num_kv_heads, head_dim),
        0,
        slots.flatten(),
        out=workspace("v", shape, v_cache.dtype, v_cache.device).view(-1, num_kv_heads, head_dim),
    )
    k, v = k.view(shape).transpose(1, 2), v.view(shape).transpose(1, 2)  # [B, Hkv, L, D]
    mask = valid[:, None, None, :].to(q.device)  # True = attend
    qg = q.view(batch, num_kv_heads, group, head_dim)
    out = F.scaled_dot_product_attention(qg, k.to(q.dtype), v.to(q.dtype), attn_mask=mask, scale=scale)
    return out.reshape(batch, num_heads, head_dim)


def paged_prefill_attention(q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale):
    """Ragged batch of new tokens: q [T, Hq, D] -> out [T, Hq, D].

    The new tokens' K/V must already be in the cache (store_kv_cache first). Each sequence's
    queries attend causally to its cached prefix and to themselves.
    """
    num_heads, num_kv_heads = q.shape[1], k_cache.shape[2]
    out = torch.empty_like(q)
    starts = query_start_loc.tolist()
    for i, total in enumerate(seq_lens.tolist()):
        start, end = starts[i], starts[i + 1]
        if end == start:
            continue
        k, v = gather_kv(k_cache, v_cache, block_tables[i], total)
        qi = q[start:end].transpose(0, 1)[None]  # [1, Hq, q_len, D]
        ki, vi = k.transpose(0, 1)[None].to(q.dtype), v.transpose(0, 1)[None].to(q.dtype)  # [1, Hkv, L, D]
        fresh = end - start == total  # no cached prefix: plain causal attention
        mask = None if fresh else causal_mask(end - start, total, q.dtype, q.device)
        oi = F.scaled_dot_product_attention(
            qi, ki, vi, attn_mask=mask, is_causal=fresh, scale=scale, enable_gqa=num_heads != num_kv_heads
        )
        out[start:end] = oi[0].transpose(0, 1)
    return out


def causal_mask(q_len, total, dtype, device):
    """Additive mask [q_len, total]: query j (at position total - q_len + j) sees keys <= itself."""
    query_pos = torch.arange(total - q_len, total, device=device)[:, None]
    key_pos = torch.arange(total, device=device)[None, :]
    mask = torch.zeros(q_len, total, dtype=dtype, device=device)
    return mask.masked_fill_(key_pos > query_pos, float("-inf"))


def rms_norm(x, weight, eps):
    """RMSNorm in float32, cast back to x's dtype (as HF Llama does)."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def fused_add_rms_norm(x, residual, weight, eps):
    """residual' = x + residual (or x when residual is None); returns (rms_norm(residual'), residual')."""
    new_residual = x if residual is None else x + residual
    return rms_norm(new_residual, weight, eps), new_residual


def rotary_embedding(positions, q, k, cos_sin_cache) -> None:
    """Neox-style rotary applied in place to q [T, Hq, D] and k [T, Hkv, D].

    cos_sin_cache: [max_position, D] holding cos in the first D/2 columns and sin in the rest
    (llama3 frequency scaling, when used, is already baked into the cache).
    """
    cos_sin = cos_sin_cache.index_select(0, positions.long())
    half = cos_sin.shape[-1] // 2
    cos = cos_sin[:, None, :half]
    sin = cos_sin[:, None, half:]
    for x in (q, k):
        x1, x2 = x[..., :half], x[..., half:]
        r1 = x1.float() * cos - x2.float() * sin
        r2 = x2.float() * cos + x1.float() * sin
        x[..., :half] = r1.to(x.dtype)
        x[..., half:] = r2.to(x.dtype)


def silu_and_mul(x):
    """x [T, 2I] = [gate | up] -> silu(gate) * up, [T, I]."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate).mul_(up)  # in place: one [T, I] temporary instead of two


def gelu_tanh_and_mul(x):
    """x [T, 2I] = [gate | up] -> gelu(gate) * up with gelu's tanh form (Gemma's MLP), [T, I]."""
    gate, up = x.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh").mul_(up)
