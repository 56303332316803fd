"""tessera_kernels.cache.store_kv_cache against torch_ref.store_kv_cache."""

import pytest
import torch
from _kernel_testlib import DEVICE, randn

from tessera_kernels import torch_ref
from tessera_kernels.cache import store_kv_cache

pytestmark = pytest.mark.cuda


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("num_kv_heads,head_dim", [(1, 64), (2, 128), (3, 80)])
def test_store_kv_matches_reference(dtype, block_size, num_kv_heads, head_dim):
    num_blocks, num_tokens = 5, 9
    # k and v as strided column slices of one fused qkv tensor, as the model produces them.
    qkv = randn(num_tokens, 4 * num_kv_heads * head_dim, dtype=dtype, seed=3)
    kv_width = num_kv_heads * head_dim
    k = qkv[:, 2 * kv_width : 3 * kv_width].view(num_tokens, num_kv_heads, head_dim)
    v = qkv[:, 3 * kv_width :].view(num_tokens, num_kv_heads, head_dim)
    assert not k.is_contiguous()
    # Shuffled, non-contiguous slots across blocks, including a block's first and last slot,
    # with two -1 (skip) tokens.
    gen = torch.Generator().manual_seed(block_size)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[0], slots[1] = 0, num_blocks * block_size - 1
    slots[3] = slots[6] = -1
    slots = slots.to(DEVICE)
    k_cache = randn(num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype, seed=4)
    v_cache = randn(num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype, seed=5)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    before = k_cache.clone()

    store_kv_cache(k, v, k_cache, v_cache, slots)
    torch_ref.store_kv_cache(k, v, k_ref, v_ref, slots)

    # A copy in the cache's own dtype is exact.
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)
    changed = (k_cache != before).flatten(2).any(-1).sum().item()
    assert 0 < changed <= num_tokens - 2  # the -1 tokens wrote nothing


def test_store_kv_all_skipped_and_empty():
    k_cache = torch.zeros(2, 16, 1, 64, device=DEVICE)
    v_cache = torch.zeros_like(k_cache)
    k = torch.ones(3, 1, 64, device=DEVICE)
    store_kv_cache(k, k, k_cache, v_cache, torch.full((3,), -1, device=DEVICE))
    store_kv_cache(k[:0], k[:0], k_cache, v_cache, torch.empty(0, dtype=torch.long, device=DEVICE))
    assert not k_cache.any() and not v_cache.any()
