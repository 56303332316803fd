"""tessera_kernels.decode_attention.paged_decode_attention against torch_ref.paged_decode_attention.

Caches come from make_paged_kv: shuffled block ids and NaN in every slot no sequence owns, so a
read past a sequence's used length (block-table padding, unwritten tail slots) fails the test.
"""

import pytest
import torch
from _kernel_testlib import assert_close, make_paged_kv, randn

from tessera_kernels import torch_ref
from tessera_kernels.decode_attention import paged_decode_attention

pytestmark = pytest.mark.cuda


def _check(lens, num_kv_heads, group, head_dim, block_size, dtype, seed=0, **kw):
    paged = make_paged_kv(lens, num_kv_heads, head_dim, block_size, dtype, seed=seed)
    q = randn(len(lens), num_kv_heads * group, head_dim, dtype=dtype, seed=seed + 100)
    scale = head_dim**-0.5
    args = (q, paged.k_cache, paged.v_cache, paged.block_tables, paged.seq_lens, scale)
    expected = torch_ref.paged_decode_attention(*args)
    out = paged_decode_attention(*args, **kw)
    assert out.dtype == q.dtype
    assert_close(out, expected, "attention", dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_matches_reference(dtype, block_size, group, num_splits):
    # 1 token, exactly one full block, one token past the boundary, and a partial third block.
    # With 3 splits the 1-token sequence leaves two splits empty (the merge must ignore them).
    lens = [1, block_size, block_size + 1, 2 * block_size + 7]
    _check(lens, 2, group, 64, block_size, dtype, num_splits=num_splits, block_n=16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [128, 80])
def test_decode_head_sizes(dtype, head_dim):
    # 80: a multiple of 16 that is not a power of two (padded tile, masked columns).
    _check([5, 33], 1, 4, head_dim, 16, dtype, seed=7, num_splits=2, block_n=32)


@pytest.mark.parametrize("block_size,block_n", [(16, 64), (32, 16), (64, 32)])
def test_decode_tiles_spanning_or_inside_blocks(block_size, block_n):
    # A K/V tile that spans several blocks, one inside a block, and a larger block size.
    _check(
        [3, 2 * block_size, 4 * block_size + 1],
        2,
        4,
        64,
        block_size,
        torch.float32,
        seed=3,
        num_splits=1,
        block_n=block_n,
    )


def test_decode_long_context_split_k():
    # Several tiles per split, splits of unequal fill, default tile size.
    _check([300, 77, 129], 1, 8, 64, 16, torch.bfloat16, seed=11, num_splits=4)


def test_decode_default_heuristics():
    _check([1, 40, 17], 2, 4, 64, 16, torch.bfloat16, seed=5)
