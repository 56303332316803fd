"""Shared helpers for the kernel tests: device choice, tolerances, paged-cache builders."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
# Natively on a GPU when there is one, else CPU tensors through the interpreter.
DEVICE = "cuda" if torch.cuda.is_available() and not INTERPRET else "cpu"

# (atol, rtol) per dtype. float32: kernels and references both compute in fp32 (tl.dot with
# input_precision="ieee", no TF32), so only summation order differs. bfloat16 keeps 8 significant
# bits (1 ulp = 2^-8..2^-7 relative); the interpreter also truncates fp32 -> bf16 where torch
# rounds to nearest, and natively P is rounded to bf16 before P @ V, so a few ulps are allowed.
TOLERANCES = {
    "attention": {torch.float32: (2e-5, 2e-5), torch.bfloat16: (2e-2, 2e-2)},
    "elementwise": {torch.float32: (1e-5, 1e-5), torch.bfloat16: (1e-2, 2.5e-2)},
}


def assert_close(actual, expected, kind, dtype):
    """assert_close in float32 with the tolerance of (kind, dtype); NaN anywhere fails."""
    atol, rtol = TOLERANCES[kind][dtype]
    assert actual.shape == expected.shape
    assert torch.isfinite(actual.float()).all(), "kernel output has NaN/Inf"
    torch.testing.assert_close(actual.float(), expected.float(), atol=atol, rtol=rtol)


def cdiv(a, b):
    return -(-a // b)


@dataclass
class PagedKV:
    k_cache: torch.Tensor  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor
    block_tables: torch.Tensor  # int32 [num_seqs, max_blocks]
    seq_lens: torch.Tensor  # int32 [num_seqs]
    poison_block: int


def make_paged_kv(
    seq_lens, num_kv_heads, head_dim, block_size, dtype, *, seed=0, spare_blocks=2, padding_cols=2, device=DEVICE
) -> PagedKV:
    """Random paged K/V for sequences of the given lengths.

    Block ids are a random permutation (non-contiguous, out of order). Every cache slot that no
    sequence owns holds NaN: spare blocks, the unused tail of each last block, and a poison block
    that all padding entries of the block table point at. A kernel that reads past a sequence's
    used length (unmasked) therefore produces NaN, which assert_close rejects.
    """
    gen = torch.Generator().manual_seed(seed)
    used = [cdiv(n, block_size) for n in seq_lens]
    num_blocks = sum(used) + spare_blocks + 1
    ids = torch.randperm(num_blocks, generator=gen)
    poison = int(ids[-1])
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(dtype)
    v_cache = torch.randn(shape, generator=gen).to(dtype)
    block_tables = torch.full((len(seq_lens), max(used) + padding_cols), poison, dtype=torch.int32)
    owned = torch.zeros(num_blocks * block_size, dtype=torch.bool)
    start = 0
    for i, (n, u) in enumerate(zip(seq_lens, used)):
        blocks = ids[start : start + u]
        start += u
        block_tables[i, :u] = blocks.to(torch.int32)
        owned[(blocks[:, None] * block_size + torch.arange(block_size)).flatten()[:n]] = True
    k_cache.view(-1, num_kv_heads, head_dim)[~owned] = float("nan")
    v_cache.view(-1, num_kv_heads, head_dim)[~owned] = float("nan")
    return PagedKV(
        k_cache.to(device),
        v_cache.to(device),
        block_tables.to(device),
        torch.tensor(seq_lens, dtype=torch.int32, device=device),
        poison,
    )


def randn(*shape, dtype, seed, device=DEVICE):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen).to(dtype).to(device)


def naive_attention(q, k_cache, v_cache, block_table, positions, scale):
    """One sequence, per query token and head, in float64: q [n, Hq, D], positions [n] (absolute);
    query at position p attends to positions 0..p, each fetched through the block table."""
    num_heads = q.shape[1]
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    out = torch.empty(q.shape, dtype=torch.float64)
    for j, p in enumerate(positions):
        for h in range(num_heads):
            keys, values = [], []
            for pos in range(p + 1):
                block = int(block_table[pos // block_size])
                keys.append(k_cache[block, pos % block_size, h // group].double())
                values.append(v_cache[block, pos % block_size, h // group].double())
            scores = torch.stack(keys) @ q[j, h].double() * scale
            out[j, h] = torch.softmax(scores, dim=0) @ torch.stack(values)
    return out
