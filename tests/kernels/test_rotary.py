"""tessera_kernels.rotary.rotary_embedding (neox, in place) against torch_ref.rotary_embedding."""

import math

import pytest
import torch
from _kernel_testlib import DEVICE, assert_close, randn

from tessera_kernels import torch_ref
from tessera_kernels.rotary import rotary_embedding

pytestmark = pytest.mark.cuda


def llama3_cos_sin_cache(head_dim, max_position, base=500000.0):
    """cos | sin table with llama3 frequency scaling, as the model code builds it."""
    inv_freq = 1.0 / base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    factor, low, high, original = 8.0, 1.0, 4.0, 8192
    wavelen = 2 * math.pi / inv_freq
    smooth = (original / wavelen - low) / (high - low)
    scaled = torch.where(wavelen > original / low, inv_freq / factor, inv_freq)
    mid = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    inv_freq = torch.where((wavelen <= original / low) & (wavelen >= original / high), mid, scaled)
    freqs = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq)
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1).to(DEVICE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (8, 2), (8, 1)])
@pytest.mark.parametrize("head_dim", [64, 128, 80])
def test_rotary_matches_reference_in_place(dtype, num_heads, num_kv_heads, head_dim):
    num_tokens, max_position = 5, 9000
    cache = llama3_cos_sin_cache(head_dim, max_position)
    positions = torch.tensor([0, 1, 17, 8191, max_position - 1], device=DEVICE)
    # q and k as strided views of one fused qkv tensor; v must stay untouched.
    widths = [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim]
    qkv = randn(num_tokens, sum(widths), dtype=dtype, seed=head_dim)
    qkv_ref = qkv.clone()
    views = []
    for t in (qkv, qkv_ref):
        q, k, v = t.split(widths, dim=-1)
        views.append((q.view(num_tokens, num_heads, head_dim), k.view(num_tokens, num_kv_heads, head_dim), v))
    (q, k, v), (q_ref, k_ref, v_ref) = views
    v_before, q_before = v.clone(), q.clone()

    rotary_embedding(positions, q, k, cache)
    torch_ref.rotary_embedding(positions, q_ref, k_ref, cache)

    assert_close(q, q_ref, "elementwise", dtype)
    assert_close(k, k_ref, "elementwise", dtype)
    assert torch.equal(v, v_before)
    assert torch.equal(q[0], q_before[0])  # position 0: cos = 1, sin = 0
    assert not torch.equal(q[1:], q_before[1:])  # really rotated in place
