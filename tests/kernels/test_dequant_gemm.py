"""tessera_kernels.dequant_gemm (int4 GPTQ / AWQ dequantize-GEMM) against tessera_kernels.quant_ref.

In Triton's interpreter on a machine without a GPU, so the shapes stay tiny; natively on CUDA.
K and N are chosen to leave partial tiles (K % 32 != 0, N % BLOCK_N != 0) so masking is exercised.
"""

import pytest
import torch
from _kernel_testlib import DEVICE, randn

from tessera_kernels import quant_ref
from tessera_kernels.dequant_gemm import dequant_gemm

pytestmark = pytest.mark.cuda

# (atol, rtol): fp32 sums in another order only; bf16 outputs keep 8 significant bits (half an ulp
# is 0.2% relative) and natively the dequantized tile is rounded to bf16 before tl.dot.
TOL = {torch.float32: (1e-4, 1e-4), torch.bfloat16: (0.1, 1e-2)}


def packed_weight(layout, k, n, group, act_order):
    weight = randn(n, k, dtype=torch.float32, seed=k + n, device="cpu")
    if layout == "gptq":
        g_idx = quant_ref.act_order_g_idx(k, group, seed=1) if act_order else None
        t = quant_ref.gptq_pack(weight, group, g_idx)
    else:
        t = quant_ref.awq_pack(weight, group)
        t["g_idx"] = (torch.arange(k) // group).to(torch.int32)
    return {name: value.to(DEVICE) for name, value in t.items()}


def reference(layout, x, t, group):
    scales = t["scales"].to(x.dtype)
    if layout == "gptq":
        return quant_ref.gptq_linear(x.float(), t["qweight"], t["qzeros"], scales.float(), t["g_idx"])
    return quant_ref.awq_linear(x.float(), t["qweight"], t["qzeros"], scales.float(), group)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "layout,m,k,n,group,act_order",
    [
        ("gptq", 1, 64, 48, 32, False),
        ("gptq", 5, 80, 40, 16, True),  # act-order g_idx: groups looked up per input row
        ("gptq", 3, 96, 24, 96, False),  # one group spanning all inputs (group_size -1)
        ("awq", 1, 64, 48, 32, False),
        ("awq", 18, 80, 72, 16, False),  # two row tiles, the second partial
    ],
)
def test_dequant_gemm_matches_reference(dtype, layout, m, k, n, group, act_order):
    t = packed_weight(layout, k, n, group, act_order)
    x = randn(m, k, dtype=dtype, seed=m)
    scales = t["scales"].to(dtype)
    out = dequant_gemm(x, t["qweight"], t["qzeros"], scales, t["g_idx"], layout, 1 if layout == "gptq" else 0)
    expected = reference(layout, x, t, group)
    assert out.shape == (m, n) and out.dtype == dtype
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(out.float(), expected, atol=atol, rtol=rtol)


def test_dequant_gemm_keeps_leading_dims_and_adds_bias():
    t = packed_weight("awq", 32, 16, 16, False)
    x = randn(2, 3, 32, dtype=torch.float32, seed=9)
    bias = randn(16, dtype=torch.float32, seed=10)
    out = dequant_gemm(x, t["qweight"], t["qzeros"], t["scales"].float(), t["g_idx"], "awq", 0, bias)
    expected = reference("awq", x.reshape(6, 32), t, 16).reshape(2, 3, 16) + bias
    torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4)


def test_dequant_gemm_rejects_unknown_layout():
    t = packed_weight("awq", 32, 16, 16, False)
    with pytest.raises(ValueError, match="layout"):
        dequant_gemm(torch.zeros(1, 32, device=DEVICE), t["qweight"], t["qzeros"], t["scales"], t["g_idx"], "exl2")


def test_pack_and_unpack_are_inverse():
    values = torch.randint(0, 16, (16, 24), generator=torch.Generator().manual_seed(0))
    assert torch.equal(quant_ref.unpack_int4_rows(quant_ref.pack_int4_rows(values)), values)
    assert torch.equal(quant_ref.unpack_int4_cols(quant_ref.pack_int4_cols(values)), values)
    packed = quant_ref.pack_int4_cols(values, quant_ref.AWQ_PACK_ORDER)
    assert torch.equal(quant_ref.unpack_int4_cols(packed, quant_ref.AWQ_UNPACK_ORDER), values)
