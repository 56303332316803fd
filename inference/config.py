"""Engine arguments (vLLM's names) and the model facts read from config.json or a GGUF file."""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import torch

from inference.gguf_files import generation_defaults, is_gguf

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Phi3ForCausalLM": "phi3",
    "GemmaForCausalLM": "gemma",
}
# The gated MLP's activations; a family's default where its config names none.
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")
DEFAULT_ACTIVATION = {"gemma": "gelu_pytorch_tanh"}
# Families whose sliding_window applies unless the config says use_sliding_window: false.
SLIDING_BY_DEFAULT = ("mistral", "phi3")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class EngineArgs:
    model: str
    dtype: str = "auto"
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    num_kv_blocks: int | None = None
    kv_cache_memory: int = 2 << 30  # bytes for the KV pool on CPU
    gpu_memory_utilization: float = 0.9
    device: str = "auto"
    seed: int = 0
    load_format: str = "auto"  # "auto" (safetensors or a .gguf file) or "dummy" (random weights)
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int | None = None  # cap on one prefill's share of a step
    scheduler_delay_ms: float = 0.0
    scheduling_policy: str = "priority"  # "fcfs", "priority" or "fair" (fair share between tenants)
    attention_backend: str | None = None  # "torch" or "triton"; default by device
    enforce_eager: bool = False  # never replay captured decode steps (inference/decode_graph.py)
    tensor_parallel_size: int = 1
    quantization: str | None = None
    # GGUF weights: "packed" (the file's blocks, C kernels), "float32" or "bfloat16" (dequantized at load);
    # "auto" packs a GGUF file on CPU unless dtype names a float type (inference/quantization/__init__.py).
    weights: str = "auto"
    served_model_name: str | None = None
    # vLLM's speculative decoding argument, a dict or JSON: {"method": "ngram" | "draft_model",
    # "num_speculative_tokens": k, "prompt_lookup_min"/"prompt_lookup_max": n, "model": draft path}
    speculative_config: dict | str | None = None

    def __post_init__(self):
        if self.weights in DTYPES and self.dtype not in ("auto", self.weights):
            raise ValueError(f"weights={self.weights!r} and dtype={self.dtype!r} disagree; set one of them")
        if self.weights in DTYPES:
            self.dtype = self.weights

    @classmethod
    def names(cls) -> set[str]:
        return {f.name for f in fields(cls)}

    def to_dict(self) -> dict:
        return asdict(self)


def activation(path: str, family: str, raw: dict) -> str:
    """The gated MLP's activation; one the layer code lacks fails at start-up, by name."""
    name = raw.get("hidden_activation") or raw.get("hidden_act") or DEFAULT_ACTIVATION.get(family, "silu")
    if family == "gemma" and name == "gelu":  # early Gemma configs; transformers reads it as the tanh form too
        name = "gelu_pytorch_tanh"
    if name not in ACTIVATIONS:
        raise ValueError(f"hidden_act {name!r} in {path}: the gated MLP takes {' or '.join(ACTIVATIONS)}")
    return name


def check_layer_options(path: str, raw: dict) -> None:
    """Config options the layer code does not implement fail at start-up, by name."""
    if raw.get("use_bidirectional_attention"):  # EmbeddingGemma's encoder
        raise ValueError(f"use_bidirectional_attention in {path}: the layers are causal")
    rope = raw.get("rope_parameters") or {}
    partial = raw.get("partial_rotary_factor", rope.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        raise ValueError(
            f"partial_rotary_factor {partial} in {path}: rotary embeddings over part of a head are not supported"
        )


def longrope(raw: dict, rope: dict) -> tuple[dict, int]:
    """Phi-3's LongRoPE as (the rotary scaling we apply, the positions served). Its short factors hold up to
    the original context; past it transformers switches every position of a batch to the long factors, so the
    context is capped there, where the model is exact (as a sliding window caps Mistral's)."""
    original = rope.get("original_max_position_embeddings") or raw["original_max_position_embeddings"]
    factor = rope.get("factor") or raw["max_position_embeddings"] / original
    attention = rope.get("attention_factor") or (
        1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    )
    return {"rope_type": "longrope", "short_factor": rope["short_factor"], "attention_factor": attention}, original


@dataclass
class ModelConfig:
    """The architecture facts the model code needs, from an HF config.json or GGUF metadata."""

    path: str
    architecture: str
    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    sliding_window: int | None
    torch_dtype: str | None
    bos_token_id: int | None
    eos_token_ids: list[int]
    raw: dict
    # The model's own sampling defaults (generation_config.json / GGUF general.sampling.*).
    generation_defaults: dict = field(default_factory=dict)
    hidden_act: str = "silu"
    # Gemma: embeddings scaled by sqrt(hidden_size); each RMSNorm multiplies by 1 + its stored weight.
    embedding_scale: float | None = None
    norm_weight_offset: float = 0.0

    @classmethod
    def from_path(cls, path: str) -> "ModelConfig":
        if is_gguf(path):
            from inference import gguf_loader

            cfg = cls.from_dict(path, gguf_loader.config_dict(path))
            cfg.generation_defaults = generation_defaults(path)
            return cfg
        folder = Path(path)
        config_file = folder / "config.json"
        if not folder.is_dir():
            raise FileNotFoundError(f"model folder {folder} does not exist")
        if not config_file.exists():
            raise FileNotFoundError(f"model folder {folder} has no config.json")
        cfg = cls.from_dict(str(folder), json.loads(config_file.read_text()))
        cfg.generation_defaults = generation_defaults(path)
        cfg.add_generation_eos(folder / "generation_config.json")
        return cfg

    def add_generation_eos(self, file: Path) -> None:
        """generation_config.json's eos_token_id (often a list of end-of-turn ids) stops generation too."""
        if not file.exists():
            return
        eos = json.loads(file.read_text()).get("eos_token_id")
        extra = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        self.eos_token_ids = sorted(set(self.eos_token_ids) | set(extra))

    @classmethod
    def from_dict(cls, path: str, raw: dict) -> "ModelConfig":
        archs = raw.get("architectures") or []
        supported = [a for a in archs if a in SUPPORTED_ARCHITECTURES]
        if not supported:
            raise ValueError(
                f"unsupported architecture {archs or raw.get('model_type')!r} in {path}; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        arch = supported[0]
        family = SUPPORTED_ARCHITECTURES[arch]
        num_heads = raw["num_attention_heads"]
        hidden = raw["hidden_size"]
        rope = raw.get("rope_scaling") or raw.get("rope_parameters")
        theta = raw.get("rope_theta") or (rope or {}).get("rope_theta") or 10000.0
        check_layer_options(path, raw)
        positions = raw.get("max_position_embeddings", 2048)
        if rope and rope.get("rope_type", rope.get("type")) in (None, "default"):
            rope = None
        elif rope and rope.get("rope_type", rope.get("type")) == "longrope":
            rope, positions = longrope(raw, rope)
        eos = raw.get("eos_token_id")
        sliding = raw.get("sliding_window") if raw.get("use_sliding_window", family in SLIDING_BY_DEFAULT) else None
        return cls(
            path=path,
            architecture=arch,
            family=family,
            vocab_size=raw["vocab_size"],
            hidden_size=hidden,
            intermediate_size=raw["intermediate_size"],
            num_layers=raw["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=raw.get("num_key_value_heads") or num_heads,
            head_dim=raw.get("head_dim") or hidden // num_heads,
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            rope_scaling=rope,
            max_position_embeddings=positions,
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=bool(raw.get("attention_bias", family == "qwen2")),
            sliding_window=sliding,
            torch_dtype=raw.get("torch_dtype") or raw.get("dtype"),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=[] if eos is None else ([eos] if isinstance(eos, int) else list(eos)),
            raw=raw,
            hidden_act=activation(path, family, raw),
            embedding_scale=hidden**0.5 if family == "gemma" else None,
            norm_weight_offset=1.0 if family == "gemma" else 0.0,
        )

    def resolve_dtype(self, dtype: str) -> torch.dtype:
        if dtype == "auto":
            dtype = self.torch_dtype if self.torch_dtype in DTYPES else "float32"
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of auto, {', '.join(DTYPES)}; got {dtype!r}")
        return DTYPES[dtype]
