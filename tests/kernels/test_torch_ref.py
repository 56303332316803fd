"""The torch references themselves, checked against naive per-token loops (float64).

These are what the Triton kernels are compared with, so they must be right independently.
"""

import pytest
import torch
from _kernel_testlib import cdiv, make_paged_kv, naive_attention

from tessera_kernels import torch_ref

SCALE = 0.125


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("group", [1, 4])
def test_reference_decode_matches_naive_loop(block_size, group):
    lens = [1, block_size, block_size + 1, 2 * block_size + 5]
    paged = make_paged_kv(lens, 2, 32, block_size, torch.float32, seed=1, device="cpu")
    q = torch.randn(len(lens), 2 * group, 32)
    out = torch_ref.paged_decode_attention(q, paged.k_cache, paged.v_cache, paged.block_tables, paged.seq_lens, SCALE)
    assert torch.isfinite(out).all(), "the reference read a padding entry or an unwritten slot"
    for i, n in enumerate(lens):
        expected = naive_attention(q[i : i + 1], paged.k_cache, paged.v_cache, paged.block_tables[i], [n - 1], SCALE)
        torch.testing.assert_close(out[i : i + 1].double(), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("group", [1, 4])
def test_reference_prefill_matches_naive_loop(block_size, group):
    # (cached prefix, new tokens): 1 token, prompt ending on a block boundary, one token past a
    # cached boundary, an extend across blocks, and a sequence with no new tokens this step.
    cases = [(0, 1), (0, block_size), (block_size, 1), (block_size - 3, 9), (block_size, 0)]
    lens = [c + n for c, n in cases]
    paged = make_paged_kv(lens, 2, 32, block_size, torch.float32, seed=2, device="cpu")
    q_lens = [n for _, n in cases]
    qsl = torch.tensor([0] + q_lens).cumsum(0).to(torch.int32)
    q = torch.randn(sum(q_lens), 2 * group, 32)
    out = torch_ref.paged_prefill_attention(
        q, paged.k_cache, paged.v_cache, paged.block_tables, qsl, paged.seq_lens, SCALE
    )
    assert torch.isfinite(out).all()
    for i, (ctx, n) in enumerate(cases):
        if n == 0:
            continue
        s = int(qsl[i])
        expected = naive_attention(
            q[s : s + n], paged.k_cache, paged.v_cache, paged.block_tables[i], list(range(ctx, ctx + n)), SCALE
        )
        torch.testing.assert_close(out[s : s + n].double(), expected, atol=1e-5, rtol=1e-5)


def test_reference_store_kv_matches_naive_loop():
    block_size, num_blocks = 16, 6
    k = torch.randn(5, 2, 32)
    v = torch.randn(5, 2, 32)
    slots = torch.tensor([17, -1, 3, 95, -1])
    k_cache = torch.zeros(num_blocks, block_size, 2, 32)
    v_cache = torch.zeros_like(k_cache)
    torch_ref.store_kv_cache(k, v, k_cache, v_cache, slots)
    k_expected = torch.zeros_like(k_cache)
    v_expected = torch.zeros_like(v_cache)
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            k_expected[slot // block_size, slot % block_size] = k[t]
            v_expected[slot // block_size, slot % block_size] = v[t]
    assert torch.equal(k_cache, k_expected) and torch.equal(v_cache, v_expected)
    assert int((k_cache != 0).any(-1).any(-1).sum()) == 3  # the two -1 tokens wrote nothing


def test_poisoned_cache_fixture_is_effective():
    """The NaN poison in make_paged_kv would show up in any read past a sequence's length."""
    block_size = 16
    paged = make_paged_kv([3, 40], 1, 16, block_size, torch.float32, device="cpu")
    assert int(paged.block_tables[0, 1]) == paged.poison_block
    assert torch.isnan(paged.k_cache[paged.poison_block]).all()
    last = int(paged.block_tables[0, cdiv(3, block_size) - 1])
    assert torch.isfinite(paged.k_cache[last, :3]).all() and torch.isnan(paged.k_cache[last, 3:]).all()
