"""TritonOps (the "triton" backend) against TorchOps through the engine-facing interface."""
import pytest
import torch

from _kernel_testlib import DEVICE, assert_close, randn
from inference.layers.ops import AttentionMetadata, TorchOps, get_ops

pytestmark = pytest.mark.cuda


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_ops_match_torch_ops_over_prefill_then_decode(dtype):
    triton_ops, torch_ops = get_ops("triton"), TorchOps()
    assert triton_ops.name == "triton"
    block_size, num_blocks, hq, hkv, d = 16, 8, 8, 2, 64
    caches = {name: (torch.zeros(num_blocks, block_size, hkv, d, dtype=dtype, device=DEVICE),
                     torch.zeros(num_blocks, block_size, hkv, d, dtype=dtype, device=DEVICE))
              for name in ("triton", "torch")}
    block_tables = torch.tensor([[5, 2, 0], [7, 1, 0]], dtype=torch.int32, device=DEVICE)  # padded rows
    # Prefill: sequence 0 has 17 prompt tokens (one past a block), sequence 1 has 3.
    prompt = [17, 3]
    positions = torch.cat([torch.arange(n) for n in prompt]).to(DEVICE)
    slots = torch.cat([block_tables[i, positions_i // block_size].long() * block_size + positions_i % block_size
                       for i, positions_i in enumerate(torch.arange(n, device=DEVICE) for n in prompt)])
    steps = [
        (AttentionMetadata(slots, torch.tensor([0, 17, 20], dtype=torch.int32, device=DEVICE),
                           torch.tensor(prompt, dtype=torch.int32, device=DEVICE), block_tables, False), positions),
        # Decode: one more token each (positions 17 and 3).
        (AttentionMetadata(torch.tensor([2 * block_size + 1, 7 * block_size + 3], device=DEVICE),
                           torch.tensor([0, 1, 2], dtype=torch.int32, device=DEVICE),
                           torch.tensor([18, 4], dtype=torch.int32, device=DEVICE), block_tables, True),
         torch.tensor([17, 3], device=DEVICE)),
    ]
    cos_sin = torch.randn(64, d, device=DEVICE)
    for step, (meta, pos) in enumerate(steps):
        t = pos.shape[0]
        q, k, v = (randn(t, h, d, dtype=dtype, seed=10 * step + i) for i, h in enumerate((hq, hkv, hkv)))
        q_rot = {}
        for name, ops in (("triton", triton_ops), ("torch", torch_ops)):
            qn, kn = q.clone(), k.clone()
            ops.rotary(pos, qn, kn, cos_sin)
            q_rot[name] = (qn, kn)
        for a, b in zip(q_rot["triton"], q_rot["torch"]):
            assert_close(a, b, "elementwise", dtype)
        # Attention sees identical inputs in both backends (bf16 rotary rounding would otherwise
        # compound through the scores), so any difference is the store/attention kernels'.
        qn, kn = q_rot["torch"]
        outs = {}
        for name, ops in (("triton", triton_ops), ("torch", torch_ops)):
            ops.store_kv(kn, v, *caches[name], meta.slot_mapping)
            outs[name] = ops.attention(qn, *caches[name], meta, d ** -0.5)
        assert torch.equal(caches["triton"][0], caches["torch"][0])
        assert torch.equal(caches["triton"][1], caches["torch"][1])
        assert_close(outs["triton"], outs["torch"], "attention", dtype)

    x = randn(3, 128, dtype=dtype, seed=1)
    res = randn(3, 128, dtype=dtype, seed=2)
    w = randn(128, dtype=dtype, seed=3)
    for a, b in zip(triton_ops.fused_add_rms_norm(x, res, w, 1e-5), torch_ops.fused_add_rms_norm(x, res, w, 1e-5)):
        assert_close(a, b, "elementwise", dtype)
    gate_up = randn(3, 96, dtype=dtype, seed=4)
    assert_close(triton_ops.silu_and_mul(gate_up), torch_ops.silu_and_mul(gate_up), "elementwise", dtype)


def test_triton_ops_has_every_torch_ops_method():
    public = lambda cls: {n for n in dir(cls) if not n.startswith("_")}  # noqa: E731
    assert public(TorchOps) <= public(type(get_ops("triton")))
