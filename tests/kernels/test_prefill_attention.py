"""tessera_kernels.prefill_attention.paged_prefill_attention against torch_ref.paged_prefill_attention.

A ragged batch mixing fresh prompts, extends over a cached prefix, single tokens and a sequence
with no new tokens; caches are NaN-poisoned outside what each sequence owns (see make_paged_kv).
"""

import pytest
import torch
from _kernel_testlib import assert_close, make_paged_kv, randn

from tessera_kernels import torch_ref
from tessera_kernels.prefill_attention import paged_prefill_attention

pytestmark = pytest.mark.cuda


def _check(cases, num_kv_heads, group, head_dim, block_size, dtype, seed=0, **kw):
    """cases: (cached prefix length, new tokens) per sequence."""
    lens = [ctx + n for ctx, n in cases]
    paged = make_paged_kv(lens, num_kv_heads, head_dim, block_size, dtype, seed=seed)
    q_lens = [n for _, n in cases]
    qsl = torch.tensor([0] + q_lens).cumsum(0).to(torch.int32).to(paged.seq_lens.device)
    q = randn(sum(q_lens), num_kv_heads * group, head_dim, dtype=dtype, seed=seed + 100)
    scale = head_dim**-0.5
    args = (q, paged.k_cache, paged.v_cache, paged.block_tables, qsl, paged.seq_lens, scale)
    expected = torch_ref.paged_prefill_attention(*args)
    out = paged_prefill_attention(*args, **kw)
    assert out.dtype == q.dtype
    assert_close(out, expected, "attention", dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("group", [1, 4, 8])
def test_prefill_matches_reference(dtype, block_size, group):
    cases = [
        (0, 1),  # a 1-token prompt
        (0, block_size),  # a prompt ending exactly on a block boundary
        (block_size, 1),  # one token past a cached full block
        (block_size - 3, 20),  # extend (chunked prefill / prefix hit) crossing blocks, 2 query tiles
        (2 * block_size, 0),  # no new tokens this step
    ]
    _check(cases, 2, group, 64, block_size, dtype, block_m=16, block_n=16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [128, 80])
def test_prefill_head_sizes(dtype, head_dim):
    _check([(0, 9), (7, 12)], 1, 4, head_dim, 16, dtype, seed=4, block_m=16, block_n=32)


def test_prefill_many_tiles_and_sequences():
    # Several query tiles per sequence and many sequences: exercises the tile -> sequence search,
    # including empty sequences between non-empty ones.
    cases = [(0, 40), (5, 0), (0, 0), (3, 17), (64, 33), (1, 1)]
    _check(cases, 1, 8, 64, 16, torch.bfloat16, seed=9, block_m=16, block_n=32)


def test_prefill_default_tiles():
    _check([(0, 70), (20, 5)], 2, 4, 64, 16, torch.float32, seed=6)
