"""The one interface the model code calls for its hot operations.

A backend is chosen once at start-up ("torch" on CPU, "triton" on CUDA, overridable with
`attention_backend=`); layers never branch on the device themselves. Both backends are the same
Ops class over a different set of primitives with identical signatures: kernels/tessera_kernels/torch_ref.py
(what the CPU runs) or the Triton launchers in tessera_kernels.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import torch


@dataclass
class AttentionMetadata:
    """Per-step layout of the flattened batch (see kernels/tessera_kernels/torch_ref.py for the conventions).

    Sequences with one new token (decodes) come first, so attention runs them as one batched
    decode and only the rest (prefill chunks) through the ragged prefill path.
    """

    slot_mapping: torch.Tensor  # int64 [num_tokens]
    query_start_loc: torch.Tensor  # int32 [num_seqs + 1]
    seq_lens: torch.Tensor  # int32 [num_seqs]
    block_tables: torch.Tensor  # int32 [num_seqs, max_blocks]
    num_decodes: int  # the first num_decodes sequences have exactly one new token

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]

    @property
    def decode_only(self) -> bool:
        return self.num_decodes == self.num_seqs


class Ops:
    def __init__(self, name: str, primitives):
        self.name = name
        self.p = primitives

    def store_kv(self, k, v, k_cache, v_cache, slot_mapping):
        self.p.store_kv_cache(k, v, k_cache, v_cache, slot_mapping)

    def attention(self, q, k_cache, v_cache, meta: AttentionMetadata, scale: float):
        nd = meta.num_decodes
        if meta.decode_only:
            return self.p.paged_decode_attention(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, scale)
        if nd == 0:
            return self.p.paged_prefill_attention(
                q, k_cache, v_cache, meta.block_tables, meta.query_start_loc, meta.seq_lens, scale
            )
        decode = self.p.paged_decode_attention(
            q[:nd], k_cache, v_cache, meta.block_tables[:nd], meta.seq_lens[:nd], scale
        )
        prefill = self.p.paged_prefill_attention(
            q[nd:], k_cache, v_cache, meta.block_tables[nd:], meta.query_start_loc[nd:] - nd, meta.seq_lens[nd:], scale
        )
        return torch.cat([decode, prefill])

    def fused_add_rms_norm(self, x, residual, weight, eps):
        return self.p.fused_add_rms_norm(x, residual, weight, eps)

    def rotary(self, positions, q, k, cos_sin_cache):
        self.p.rotary_embedding(positions, q, k, cos_sin_cache)

    def silu_and_mul(self, x):
        return self.p.silu_and_mul(x)

    def gelu_tanh_and_mul(self, x):
        return self.p.gelu_tanh_and_mul(x)


PRIMITIVES = (
    "store_kv_cache",
    "paged_decode_attention",
    "paged_prefill_attention",
    "fused_add_rms_norm",
    "rotary_embedding",
    "silu_and_mul",
    "gelu_tanh_and_mul",  # no C kernel: torch's on CPU
)


def torch_primitives():
    """tessera_kernels/torch_ref.py, with the C kernels on CPU where they build (tessera_kernels/native_cpu.py).

    Each C kernel takes float32 and bfloat16 on CPU; any other input goes to its reference.
    """
    from inference.layers import onednn
    from tessera_kernels import native_cpu, torch_ref

    if native_cpu.load() is None:
        return torch_ref

    # The C kernels write into outputs with room for the next GEMM's padded rows (onednn.empty_rows).
    def paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale):
        if not native_cpu.supports(q, k_cache):
            return torch_ref.paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale)
        return native_cpu.paged_decode_attention(
            q, k_cache, v_cache, block_tables, seq_lens, scale, out=onednn.empty_rows(*q.shape, like=q)
        )

    def paged_prefill_attention(q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale):
        if not native_cpu.supports_prefill(q, k_cache):
            return torch_ref.paged_prefill_attention(
                q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale
            )
        return native_cpu.paged_prefill_attention(
            q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale, out=onednn.empty_rows(*q.shape, like=q)
        )

    def fused_add_rms_norm(x, residual, weight, eps):
        tensors = (x, weight) if residual is None else (x, residual, weight)
        if not native_cpu.supports_rows(*tensors):
            return torch_ref.fused_add_rms_norm(x, residual, weight, eps)
        return native_cpu.fused_add_rms_norm(x, residual, weight, eps, out=onednn.empty_rows(*x.shape, like=x))

    def silu_and_mul(x):
        if not native_cpu.supports_rows(x):
            return torch_ref.silu_and_mul(x)
        return native_cpu.silu_and_mul(x, out=onednn.empty_rows(*x.shape[:-1], x.shape[-1] // 2, like=x))

    def rotary_embedding(positions, q, k, cos_sin_cache):
        impl = native_cpu if native_cpu.supports_rotary(q, k, cos_sin_cache) else torch_ref
        impl.rotary_embedding(positions, q, k, cos_sin_cache)

    def store_kv_cache(k, v, k_cache, v_cache, slot_mapping):
        impl = native_cpu if native_cpu.supports_store(k, v, k_cache, v_cache) else torch_ref
        impl.store_kv_cache(k, v, k_cache, v_cache, slot_mapping)

    chosen = {name: getattr(torch_ref, name) for name in PRIMITIVES}
    chosen.update(
        paged_decode_attention=paged_decode_attention,
        paged_prefill_attention=paged_prefill_attention,
        fused_add_rms_norm=fused_add_rms_norm,
        silu_and_mul=silu_and_mul,
        rotary_embedding=rotary_embedding,
        store_kv_cache=store_kv_cache,
    )
    return SimpleNamespace(**chosen)


def triton_primitives():
    # _triton_utils first: on a CUDA-less machine it selects the interpreter before triton loads.
    from tessera_kernels import _triton_utils  # noqa: F401
    from tessera_kernels.activation import gelu_tanh_and_mul, silu_and_mul
    from tessera_kernels.cache import store_kv_cache
    from tessera_kernels.decode_attention import paged_decode_attention
    from tessera_kernels.norm import fused_add_rms_norm
    from tessera_kernels.prefill_attention import paged_prefill_attention
    from tessera_kernels.rotary import rotary_embedding

    return SimpleNamespace(
        store_kv_cache=store_kv_cache,
        paged_decode_attention=paged_decode_attention,
        paged_prefill_attention=paged_prefill_attention,
        fused_add_rms_norm=fused_add_rms_norm,
        rotary_embedding=rotary_embedding,
        silu_and_mul=silu_and_mul,
        gelu_tanh_and_mul=gelu_tanh_and_mul,
    )


BACKENDS = {"torch": torch_primitives, "triton": triton_primitives}


def get_ops(name: str) -> Ops:
    """Backend by name: "torch" or "triton" (the latter imports Triton lazily)."""
    if name not in BACKENDS:
        raise ValueError(f"unknown attention_backend {name!r}; expected one of {', '.join(BACKENDS)}")
    return Ops(name, BACKENDS[name]())
