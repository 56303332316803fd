"""The "triton" backend (ops.get_ops("triton")) against the "torch" backend through the
engine-facing Ops interface: prefill, a mixed decode + prefill-chunk step, then pure decode."""

import pytest
import torch
from _kernel_testlib import DEVICE, assert_close, randn

from inference.layers.ops import BACKENDS, AttentionMetadata, get_ops
from tessera_kernels import torch_ref

pytestmark = pytest.mark.cuda


def _i32(values):
    return torch.tensor(values, dtype=torch.int32, device=DEVICE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_backend_matches_torch_backend(dtype):
    backends = {"triton": get_ops("triton"), "torch": get_ops("torch")}
    assert backends["triton"].name == "triton"
    block_size, num_blocks, hq, hkv, d = 16, 8, 8, 2, 64
    caches = {
        name: (
            torch.zeros(num_blocks, block_size, hkv, d, dtype=dtype, device=DEVICE),
            torch.zeros(num_blocks, block_size, hkv, d, dtype=dtype, device=DEVICE),
        )
        for name in backends
    }
    block_tables = _i32([[5, 2, 0], [7, 1, 0]])  # rows padded past their used blocks

    def slots(seq, positions):
        return torch.tensor(
            [int(block_tables[seq, p // block_size]) * block_size + p % block_size for p in positions], device=DEVICE
        )

    # (metadata, positions of the new tokens)
    steps = [
        # Prefill: sequence 0 gets 17 prompt tokens (one past a block), sequence 1 gets 3.
        (
            AttentionMetadata(
                torch.cat([slots(0, range(17)), slots(1, range(3))]), _i32([0, 17, 20]), _i32([17, 3]), block_tables, 0
            ),
            list(range(17)) + list(range(3)),
        ),
        # Mixed: sequence 0 decodes position 17; sequence 1 prefills a chunk at positions 3..14.
        (
            AttentionMetadata(
                torch.cat([slots(0, [17]), slots(1, range(3, 15))]), _i32([0, 1, 13]), _i32([18, 15]), block_tables, 1
            ),
            [17] + list(range(3, 15)),
        ),
        # Decode only: positions 18 and 15 (sequence 1 then ends exactly on a block boundary).
        (
            AttentionMetadata(
                torch.cat([slots(0, [18]), slots(1, [15])]), _i32([0, 1, 2]), _i32([19, 16]), block_tables, 2
            ),
            [18, 15],
        ),
    ]
    cos_sin = torch.randn(64, d, device=DEVICE)
    for step, (meta, positions) in enumerate(steps):
        pos = torch.tensor(positions, device=DEVICE)
        t = pos.shape[0]
        q, k, v = (randn(t, h, d, dtype=dtype, seed=10 * step + i) for i, h in enumerate((hq, hkv, hkv)))
        rotated = {}
        for name, ops in backends.items():
            qn, kn = q.clone(), k.clone()
            ops.rotary(pos, qn, kn, cos_sin)
            rotated[name] = (qn, kn)
        for a, b in zip(rotated["triton"], rotated["torch"]):
            assert_close(a, b, "elementwise", dtype)
        # Attention sees identical inputs in both backends (bf16 rotary rounding would otherwise
        # compound through the scores), so any difference is the store/attention kernels'.
        qn, kn = rotated["torch"]
        outs = {}
        for name, ops in backends.items():
            ops.store_kv(kn, v, *caches[name], meta.slot_mapping)
            outs[name] = ops.attention(qn, *caches[name], meta, d**-0.5)
        assert torch.equal(caches["triton"][0], caches["torch"][0])
        assert torch.equal(caches["triton"][1], caches["torch"][1])
        assert_close(outs["triton"], outs["torch"], "attention", dtype)

    x = randn(3, 128, dtype=dtype, seed=1)
    res = randn(3, 128, dtype=dtype, seed=2)
    w = randn(128, dtype=dtype, seed=3)
    for a, b in zip(
        backends["triton"].fused_add_rms_norm(x, res, w, 1e-5), backends["torch"].fused_add_rms_norm(x, res, w, 1e-5)
    ):
        assert_close(a, b, "elementwise", dtype)
    gate_up = randn(3, 96, dtype=dtype, seed=4)
    for act in ("silu_and_mul", "gelu_tanh_and_mul"):
        triton_out, torch_out = (getattr(backends[name], act)(gate_up) for name in ("triton", "torch"))
        assert_close(triton_out, torch_out, "elementwise", dtype)


def test_triton_primitives_cover_every_reference_primitive():
    """Each primitive the Ops class calls exists in the Triton set, with the reference's signature."""
    import inspect

    triton_p = BACKENDS["triton"]()
    for name in (
        "store_kv_cache",
        "paged_decode_attention",
        "paged_prefill_attention",
        "fused_add_rms_norm",
        "rotary_embedding",
        "silu_and_mul",
        "gelu_tanh_and_mul",
    ):
        ref_params = list(inspect.signature(getattr(torch_ref, name)).parameters)
        triton_params = [
            p.name
            for p in inspect.signature(getattr(triton_p, name)).parameters.values()
            if p.kind is not inspect.Parameter.KEYWORD_ONLY
        ]
        assert triton_params == ref_params, name
