"""Compile every Triton kernel natively for an H100/H200 (sm_90) without needing a GPU.

The interpreter accepts code the real compiler rejects (type changes of loop-carried values,
dot shapes, shared-memory overflow), so this compiles each launch configuration the launchers
use down to a cubin with Triton's bundled ptxas and checks the shared-memory budget.
Run with TRITON_INTERPRET=0 (test_compile_sm90.py does): `python tests/kernels/compile_sm90.py`.
"""

from __future__ import annotations

import os
import sys

os.environ["TRITON_INTERPRET"] = "0"
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from tessera_kernels import activation, cache, decode_attention, norm, prefill_attention, rotary  # noqa: E402

SM90 = GPUTarget("cuda", 90, 32)
MAX_SHARED = 232448  # bytes of shared memory a block may opt into on sm_90
_PTR = {torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.float32: "*fp32"}


def compile_kernel(kernel, ptr_types: dict, float_args=(), meta: dict | None = None):
    """Compile `kernel` with every pointer typed from ptr_types, scalars as i32 (floats fp32)."""
    meta = dict(meta or {})
    options = {k: meta.pop(k) for k in ("num_warps", "num_stages") if k in meta}
    signature = {}
    for i, name in enumerate(kernel.arg_names):
        if i in kernel.constexprs:
            signature[name] = "constexpr"
        elif name in ptr_types:
            signature[name] = ptr_types[name]
        elif name in float_args:
            signature[name] = "fp32"
        else:
            signature[name] = "i32"
    compiled = triton.compile(ASTSource(kernel, signature, constexprs=meta), target=SM90, options=options)
    shared = compiled.metadata.shared
    assert shared <= MAX_SHARED, f"{kernel.fn.__name__}: {shared} bytes of shared memory > {MAX_SHARED}"
    return compiled


# (dtype, head_dim, block_size, group): the serving configurations (bf16, D 128/64, block 16) in
# full, plus a non-power-of-two head size, block size 32 and the fp32 test path once each, so
# a cold compile stays around half a minute.
ATTENTION_CASES = [
    (torch.bfloat16, 128, 16, 1),
    (torch.bfloat16, 128, 16, 4),
    (torch.bfloat16, 128, 16, 8),
    (torch.bfloat16, 64, 16, 8),
    (torch.bfloat16, 80, 32, 4),
    (torch.float32, 128, 16, 4),
]


def main() -> int:
    count = 0
    for dtype, head_dim, block_size, group in ATTENTION_CASES:
        dt = _PTR[dtype]
        attn_ptrs = {
            "q_ptr": dt,
            "k_cache_ptr": dt,
            "v_cache_ptr": dt,
            "out_ptr": dt,
            "block_tables_ptr": "*i32",
            "seq_lens_ptr": "*i32",
            "query_start_loc_ptr": "*i32",
            "cu_tiles_ptr": "*i32",
            "part_out_ptr": "*fp32",
            "part_lse_ptr": "*fp32",
        }
        for splits in (1, 4):
            compile_kernel(
                decode_attention._decode_split_kernel,
                attn_ptrs,
                ("scale_log2",),
                decode_attention.decode_meta(dtype, group, head_dim, block_size, splits),
            )
        compile_kernel(
            prefill_attention._prefill_kernel,
            attn_ptrs,
            ("scale_log2",),
            prefill_attention.prefill_meta(dtype, group, head_dim, block_size),
        )
        count += 3
    for dtype in (torch.bfloat16, torch.float32):
        dt = _PTR[dtype]
        compile_kernel(
            decode_attention._decode_merge_kernel,
            {"part_out_ptr": "*fp32", "part_lse_ptr": "*fp32", "out_ptr": dt},
            meta=dict(HEAD_DIM=128, NUM_SPLITS=4, BLOCK_S=4, BLOCK_D=128, num_warps=4),
        )
        compile_kernel(
            cache._store_kv_kernel,
            {n: dt for n in ("k_ptr", "v_ptr", "k_cache_ptr", "v_cache_ptr")} | {"slot_ptr": "*i64"},
            meta=cache.store_kv_meta(8, 128, 16),
        )
        compile_kernel(
            rotary._rotary_kernel,
            {"pos_ptr": "*i64", "q_ptr": dt, "k_ptr": dt, "cos_sin_ptr": "*fp32"},
            meta=rotary.rotary_meta(32, 8, 128),
        )
        for has_res in (False, True):
            compile_kernel(
                norm._fused_add_rms_norm_kernel,
                {n: dt for n in ("x_ptr", "res_ptr", "w_ptr", "out_ptr", "new_res_ptr")},
                ("eps",),
                meta=norm.norm_meta(4096) | {"HAS_RESIDUAL": has_res},
            )
        for act in (activation.SILU, activation.GELU_TANH):
            meta = activation.act_meta(14336) | {"ACTIVATION": act}
            compile_kernel(activation._act_and_mul_kernel, {"x_ptr": dt, "out_ptr": dt}, meta=meta)
        count += 7
    print(f"compiled {count} kernel configurations for sm_90")
    return 0


if __name__ == "__main__":
    sys.exit(main())
