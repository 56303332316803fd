"""tessera_kernels.activation.silu_and_mul against torch_ref.silu_and_mul."""

import pytest
import torch
from _kernel_testlib import DEVICE, assert_close, randn

from tessera_kernels import torch_ref
from tessera_kernels.activation import silu_and_mul

pytestmark = pytest.mark.cuda


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_tokens,intermediate", [(1, 48), (3, 1500), (4, 80)])
def test_silu_and_mul_matches_reference(dtype, num_tokens, intermediate):
    # 1500 > the 1024-wide column tile: two tiles per row, the second one partial.
    x = randn(num_tokens, 2 * intermediate, dtype=dtype, seed=intermediate) * 4
    out = silu_and_mul(x)
    expected = torch_ref.silu_and_mul(x)
    assert out.shape == (num_tokens, intermediate) and out.dtype == dtype
    assert_close(out, expected, "elementwise", dtype)


def test_silu_and_mul_empty():
    assert silu_and_mul(torch.empty(0, 32, device=DEVICE)).shape == (0, 16)
