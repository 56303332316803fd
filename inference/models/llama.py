"""The Llama family (Llama, Mistral, Qwen2, Phi-3, Gemma) written against our paged-attention layers.

Differences between the families are config facts (attention bias for Qwen2, tied embeddings,
RoPE theta and scaling; Gemma's activation, embedding scale and norm offset), not separate code
paths; Phi-3 checkpoints store q/k/v and gate/up fused, which the merged layers' weight loaders cut
(shard id None).
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from inference.config import ModelConfig
from inference.distributed import SINGLE, ParallelConfig
from inference.layers.attention import PagedAttention
from inference.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from inference.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    copy_checked,
    with_loader,
)
from inference.layers.ops import AttentionMetadata
from inference.layers.rotary import cos_sin_cache


class RMSNorm(nn.Module):
    def __init__(self, hidden: int, eps: float, ops, dtype, weight_offset: float = 0.0):
        super().__init__()
        weight = nn.Parameter(torch.ones(hidden, dtype=dtype), requires_grad=False)
        self.weight = with_loader(weight, functools.partial(load_offset, weight_offset)) if weight_offset else weight
        self.eps, self.ops = eps, ops

    def forward(self, x, residual=None):
        """Returns (normed, residual) with residual = x + residual: the fused add + norm."""
        return self.ops.fused_add_rms_norm(x, residual, self.weight, self.eps)


def load_offset(offset: float, param, loaded, shard_id=None) -> None:
    """Gemma's norms multiply by 1 + the stored weight: the sum is taken once, here, in float32."""
    copy_checked(param.data, loaded.float() + offset)


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, ops, dtype, linear_method=None, parallel: ParallelConfig = SINGLE):
        super().__init__()
        self.qkv_proj = QKVParallelLinear(
            cfg.hidden_size,
            cfg.head_dim,
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.attention_bias,
            dtype,
            linear_method,
            parallel,
        )
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.head_dim = cfg.head_dim
        self.o_proj = RowParallelLinear(
            cfg.num_heads * cfg.head_dim, cfg.hidden_size, False, dtype, linear_method, parallel
        )
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, cfg.head_dim, ops)
        self.ops = ops

    def forward(self, positions, hidden, meta: AttentionMetadata, cos_sin):
        q, k, v = self.qkv_proj(hidden).split(self.qkv_proj.output_sizes, dim=-1)
        tokens = hidden.shape[0]
        q = q.reshape(tokens, self.num_heads, self.head_dim)
        k = k.reshape(tokens, self.num_kv_heads, self.head_dim)
        v = v.reshape(tokens, self.num_kv_heads, self.head_dim)
        self.ops.rotary(positions, q, k, cos_sin)
        return self.o_proj(self.attn(q, k, v, meta))


class LlamaMLP(nn.Module):
    def __init__(self, cfg: ModelConfig, ops, dtype, linear_method=None, parallel: ParallelConfig = SINGLE):
        super().__init__()
        size = cfg.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(
            cfg.hidden_size, [size, size], False, dtype, linear_method, parallel
        )
        self.down_proj = RowParallelLinear(size, cfg.hidden_size, False, dtype, linear_method, parallel)
        self.act_and_mul = ops.gelu_tanh_and_mul if cfg.hidden_act == "gelu_pytorch_tanh" else ops.silu_and_mul

    def forward(self, x):
        return self.down_proj(self.act_and_mul(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, ops, dtype, linear_method=None, parallel: ParallelConfig = SINGLE):
        super().__init__()
        self.self_attn = LlamaAttention(cfg, ops, dtype, linear_method, parallel)
        self.mlp = LlamaMLP(cfg, ops, dtype, linear_method, parallel)
        norm = functools.partial(RMSNorm, cfg.hidden_size, cfg.rms_norm_eps, ops, dtype, cfg.norm_weight_offset)
        self.input_layernorm, self.post_attention_layernorm = norm(), norm()

    def forward(self, positions, hidden, residual, meta, cos_sin):
        hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden, meta, cos_sin)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaForCausalLM(nn.Module):
    """Checkpoint names follow HF; `stacked_params` maps separate HF projections onto merged ones."""

    stacked_params = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(
        self, cfg: ModelConfig, ops, dtype, max_position: int, linear_method=None, parallel: ParallelConfig = SINGLE
    ):
        super().__init__()
        self.cfg, self.parallel = cfg, parallel
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, dtype, parallel)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(cfg, ops, dtype, linear_method, parallel) for _ in range(cfg.num_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops, dtype, cfg.norm_weight_offset)
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, dtype, parallel)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        cache = cos_sin_cache(cfg.head_dim, max_position, cfg.rope_theta, cfg.rope_scaling, torch.float32)
        self.register_buffer("cos_sin", cache, persistent=False)
        # as transformers rounds it: to float32, then to the model's dtype
        scale = None if cfg.embedding_scale is None else torch.tensor(cfg.embedding_scale).to(dtype)
        self.register_buffer("embedding_scale", scale, persistent=False)

    def forward(self, input_ids, positions, meta: AttentionMetadata):
        hidden = self.embed_tokens(input_ids)
        if self.embedding_scale is not None:
            hidden = hidden * self.embedding_scale
        residual = None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual, meta, self.cos_sin)
        hidden, _ = self.norm(hidden, residual)
        return hidden

    def compute_logits(self, hidden):
        return self.lm_head.logits(hidden)

    def checkpoint_name(self, hf_name: str) -> tuple[str, object]:
        """HF parameter name -> (our parameter name, shard id or None)."""
        name = hf_name.removeprefix("model.")
        for hf_part, (ours, shard_id) in self.stacked_params.items():
            if f".{hf_part}." in name:
                return name.replace(hf_part, ours), shard_id
        return name, None
