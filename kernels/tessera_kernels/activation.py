"""Gated activations for the MLP (Triton versions of torch_ref.silu_and_mul and gelu_tanh_and_mul).

x [..., 2I] = [gate | up] -> act(gate) * up. A 2-D grid (row, column tile) keeps every program's
work bounded whatever the intermediate size. Like the reference, act(gate) is rounded to the
input dtype before the product.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# First, before triton: decides between native CUDA and the interpreter (see _triton_utils).
from tessera_kernels import _triton_utils  # noqa: F401,I001

SILU, GELU_TANH = 0, 1


@triton.jit
def _act_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_o, n_cols, ACTIVATION: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    if ACTIVATION == 0:
        act = gate / (1.0 + tl.exp(-gate))
    else:  # 0.5 x (1 + tanh(u)) = x * sigmoid(2u), u = sqrt(2 / pi) (x + 0.044715 x^3)
        u = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)
        act = gate / (1.0 + tl.exp(-2.0 * u))
    act = act.to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (act * up).to(out_ptr.dtype.element_ty), mask=mask)


def act_meta(n_cols: int) -> dict:
    """Compile-time parameters of the launch (shared with the sm_90 compile test)."""
    block = min(triton.next_power_of_2(max(n_cols, 1)), 1024)
    return dict(BLOCK=block, num_warps=4 if block >= 512 else 1)


def silu_and_mul(x):
    """x [T, 2I] = [gate | up] -> silu(gate) * up, [T, I]."""
    return act_and_mul(x, SILU)


def gelu_tanh_and_mul(x):
    """x [T, 2I] = [gate | up] -> gelu(gate) * up (tanh form), [T, I]."""
    return act_and_mul(x, GELU_TANH)


def act_and_mul(x, activation: int):
    n_cols = x.shape[-1] // 2
    x2 = x.reshape(-1, 2 * n_cols)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty(*x.shape[:-1], n_cols, dtype=x.dtype, device=x.device)
    rows = x2.shape[0]
    if rows and n_cols:
        meta = act_meta(n_cols)
        grid = (rows, triton.cdiv(n_cols, meta["BLOCK"]))
        _act_and_mul_kernel[grid](x2, out.view(-1, n_cols), x2.stride(0), n_cols, n_cols, activation, **meta)
    return out
