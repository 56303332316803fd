"""BERT-family encoders (BertModel checkpoints, sentence-transformers folders) for embeddings.

Every prompt of a step runs whole (bidirectional attention needs all its tokens at once), so the
encoder keeps no KV cache: the step's prompts lie end to end in one [tokens, hidden] batch, the
linear layers run over all of it, and attention runs per prompt, padded to the longest one.
Checkpoint names follow HF's BertModel (a "bert." prefix, as in BertForMaskedLM, is dropped).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from inference.layers.linear import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear

ENCODER_ARCHITECTURES = ("BertModel", "BertForMaskedLM", "BertForPreTraining")
ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu": nn.functional.gelu,
    "relu": nn.functional.relu,
    "gelu_new": lambda x: nn.functional.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: nn.functional.gelu(x, approximate="tanh"),
}


def is_encoder_config(raw: dict) -> bool:
    archs = raw.get("architectures") or []
    return any(a in ENCODER_ARCHITECTURES for a in archs) or (not archs and raw.get("model_type") == "bert")


@dataclass
class BertConfig:
    """The facts the encoder needs, from config.json."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    max_position_embeddings: int
    type_vocab_size: int
    layer_norm_eps: float
    hidden_act: str
    torch_dtype: str | None
    raw: dict
    tie_word_embeddings: bool = False  # what the shared weight loader asks every model

    @classmethod
    def from_dict(cls, raw: dict) -> "BertConfig":
        if raw.get("position_embedding_type", "absolute") != "absolute":
            raise ValueError(
                f"unsupported position_embedding_type {raw['position_embedding_type']!r}: "
                "only absolute position embeddings are supported"
            )
        act = raw.get("hidden_act", "gelu")
        if act not in ACTIVATIONS:
            raise ValueError(f"unsupported hidden_act {act!r}; supported: {', '.join(ACTIVATIONS)}")
        return cls(
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_layers=raw["num_hidden_layers"],
            num_heads=raw["num_attention_heads"],
            max_position_embeddings=raw["max_position_embeddings"],
            type_vocab_size=raw.get("type_vocab_size", 2),
            layer_norm_eps=raw.get("layer_norm_eps", 1e-12),
            hidden_act=act,
            torch_dtype=raw.get("torch_dtype") or raw.get("dtype"),
            raw=raw,
        )


class BertEmbeddings(nn.Module):
    def __init__(self, cfg: BertConfig, dtype):
        super().__init__()
        self.word_embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden_size, dtype=dtype)
        self.position_embeddings = nn.Embedding(cfg.max_position_embeddings, cfg.hidden_size, dtype=dtype)
        self.token_type_embeddings = nn.Embedding(cfg.type_vocab_size, cfg.hidden_size, dtype=dtype)
        self.LayerNorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps, dtype=dtype)
        for param in self.parameters():
            param.requires_grad_(False)

    def forward(self, input_ids, positions):
        # one segment per prompt: token type 0 everywhere, as sentence-transformers encodes a text
        hidden = self.word_embeddings(input_ids) + self.position_embeddings(positions)
        return self.LayerNorm(hidden + self.token_type_embeddings.weight[0])


class BertSelfAttention(nn.Module):
    def __init__(self, cfg: BertConfig, dtype):
        super().__init__()
        self.num_heads, self.head_dim = cfg.num_heads, cfg.hidden_size // cfg.num_heads
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, self.head_dim, cfg.num_heads, cfg.num_heads, True, dtype)
        self.dense = RowParallelLinear(cfg.hidden_size, cfg.hidden_size, True, dtype)
        self.LayerNorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps, dtype=dtype)

    def forward(self, hidden, lengths: list[int]):
        q, k, v = self.qkv_proj(hidden).split(self.qkv_proj.output_sizes, dim=-1)
        context = self._attend(q, k, v, lengths)
        return self.LayerNorm(self.dense(context) + hidden)

    def _attend(self, q, k, v, lengths: list[int]):
        """Bidirectional attention inside each prompt: padded to the longest, padding masked out."""
        longest, heads, dim = max(lengths), self.num_heads, self.head_dim
        mask = torch.arange(longest, device=q.device)[None, :] < torch.tensor(lengths, device=q.device)[:, None]

        def batched(x):
            padded = x.new_zeros(len(lengths), longest, heads * dim)
            padded[mask] = x
            return padded.view(len(lengths), longest, heads, dim).transpose(1, 2)

        out = nn.functional.scaled_dot_product_attention(
            batched(q), batched(k), batched(v), attn_mask=mask[:, None, None, :]
        )
        return out.transpose(1, 2).reshape(len(lengths), longest, heads * dim)[mask]


class BertLayer(nn.Module):
    def __init__(self, cfg: BertConfig, dtype):
        super().__init__()
        self.attention = BertSelfAttention(cfg, dtype)
        self.intermediate = ColumnParallelLinear(cfg.hidden_size, cfg.intermediate_size, True, dtype)
        self.output = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size, True, dtype)
        self.output_norm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps, dtype=dtype)
        self.act = ACTIVATIONS[cfg.hidden_act]
        for norm in (self.attention.LayerNorm, self.output_norm):
            for param in norm.parameters():
                param.requires_grad_(False)

    def forward(self, hidden, lengths: list[int]):
        hidden = self.attention(hidden, lengths)
        return self.output_norm(self.output(self.act(self.intermediate(hidden))) + hidden)


class BertModel(nn.Module):
    """The encoder: token states [tokens, hidden] of the prompts laid end to end."""

    # HF name part -> (ours, shard id): q/k/v are one matmul here; the rest are renamed
    stacked_params = {
        "attention.self.query": ("attention.qkv_proj", "q"),
        "attention.self.key": ("attention.qkv_proj", "k"),
        "attention.self.value": ("attention.qkv_proj", "v"),
    }
    renamed = {
        "attention.output.dense": "attention.dense",
        "attention.output.LayerNorm": "attention.LayerNorm",
        "intermediate.dense": "intermediate",
        "output.dense": "output",
        "output.LayerNorm": "output_norm",
    }
    # in BertModel checkpoints, never used for embeddings (sentence-transformers pools the token states)
    ignored_weights = ("embeddings.position_ids", "pooler.dense.weight", "pooler.dense.bias")

    def __init__(self, cfg: BertConfig, dtype):
        super().__init__()
        self.cfg = cfg
        self.embeddings = BertEmbeddings(cfg, dtype)
        self.layers = nn.ModuleList(BertLayer(cfg, dtype) for _ in range(cfg.num_layers))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        hidden = self.embeddings(input_ids, positions)
        for layer in self.layers:
            hidden = layer(hidden, lengths)
        return hidden

    def checkpoint_name(self, hf_name: str) -> tuple[str, object]:
        """HF parameter name -> (our parameter name, shard id or None)."""
        name = hf_name.removeprefix("bert.").replace("encoder.layer.", "layers.")
        for hf_part, (ours, shard_id) in self.stacked_params.items():
            if f".{hf_part}." in name:
                return name.replace(hf_part, ours), shard_id
        for hf_part, ours in self.renamed.items():
            if f".{hf_part}." in name:
                return name.replace(hf_part, ours), None
        return name, None
