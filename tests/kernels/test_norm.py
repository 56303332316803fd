"""tessera_kernels.norm.fused_add_rms_norm / rms_norm against the torch references."""

import pytest
import torch
from _kernel_testlib import assert_close, randn

from tessera_kernels import torch_ref
from tessera_kernels.norm import fused_add_rms_norm, rms_norm

pytestmark = pytest.mark.cuda

EPS = 1e-6


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hidden", [64, 80, 4096])
@pytest.mark.parametrize("with_residual", [False, True])
def test_fused_add_rms_norm_matches_reference(dtype, hidden, with_residual):
    x = randn(3, hidden, dtype=dtype, seed=1) * 3
    residual = randn(3, hidden, dtype=dtype, seed=2) if with_residual else None
    weight = randn(hidden, dtype=dtype, seed=3)
    out, new_residual = fused_add_rms_norm(x, residual, weight, EPS)
    out_ref, new_residual_ref = torch_ref.fused_add_rms_norm(x, residual, weight, EPS)
    assert out.dtype == out_ref.dtype and new_residual.dtype == new_residual_ref.dtype
    assert_close(out, out_ref, "elementwise", dtype)
    if with_residual:
        assert_close(new_residual, new_residual_ref, "elementwise", dtype)
    else:
        assert new_residual is x


def test_rms_norm_3d_input_and_fp32_weight():
    # [B, T, H] input; a float32 weight promotes the output to float32, as in the reference.
    x = randn(2, 3, 128, dtype=torch.bfloat16, seed=4)
    weight = randn(128, dtype=torch.float32, seed=5)
    out = rms_norm(x, weight, EPS)
    expected = torch_ref.rms_norm(x, weight, EPS)
    assert out.dtype == expected.dtype == torch.float32 and out.shape == x.shape
    assert_close(out, expected, "elementwise", torch.bfloat16)
