"""tessera_kernels.activation's gated activations against their torch_ref meanings."""

import pytest
import torch
from _kernel_testlib import DEVICE, assert_close, randn

from tessera_kernels import activation, torch_ref

pytestmark = pytest.mark.cuda
ACTIVATIONS = ["silu_and_mul", "gelu_tanh_and_mul"]


@pytest.mark.parametrize("name", ACTIVATIONS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_tokens,intermediate", [(1, 48), (3, 1500), (4, 80)])
def test_act_and_mul_matches_reference(name, dtype, num_tokens, intermediate):
    # 1500 > the 1024-wide column tile: two tiles per row, the second one partial.
    x = randn(num_tokens, 2 * intermediate, dtype=dtype, seed=intermediate) * 4
    out = getattr(activation, name)(x)
    expected = getattr(torch_ref, name)(x)
    assert out.shape == (num_tokens, intermediate) and out.dtype == dtype
    assert_close(out, expected, "elementwise", dtype)


@pytest.mark.parametrize("name", ACTIVATIONS)
def test_act_and_mul_empty(name):
    assert getattr(activation, name)(torch.empty(0, 32, device=DEVICE)).shape == (0, 16)
