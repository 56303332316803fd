"""GGUF files (llama.cpp's format) as a model source: config, weights, tokenizer, sampling defaults.

The header is read by inference/gguf_header.py; blocks are dequantized by the `gguf` package. Weights
are renamed to the Hugging Face Llama layout, so the rest of the loader treats them like safetensors
tensors: dequantized at load into the engine's dtype, or,
with packed weights (inference/quantization/gguf.py), each quantized matrix as the file's blocks.
llama.cpp's converter permutes the Q and K rows of Llama-architecture models (its rotary
embedding pairs adjacent dimensions, HF's pairs the two halves); that is undone here.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import re
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from inference.gguf_header import Header, read_header

logger = logging.getLogger("inference")

# GGUF general.architecture -> HF architecture. llama.cpp writes Mistral models as "llama".
ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "gemma": "GemmaForCausalLM",
}
FLOAT_TYPES = ("F32", "F16", "BF16")
# GGUF general.sampling.* -> SamplingParams field (the file's own generation defaults).
SAMPLING_KEYS = {
    "temp": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "penalty_repeat": "repetition_penalty",
}
GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
BLOCK_TENSORS = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_qkv": "self_attn.qkv_proj",  # q, k and v fused (Phi-3)
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
# Names an architecture uses for another tensor: Phi-3's ffn_up holds gate and up, fused.
ARCHITECTURE_BLOCK_TENSORS = {"phi3": {"ffn_up": "mlp.gate_up_proj"}}
# LongRoPE's frequency factors (rotary tables, not weights: config_dict reads the short ones).
ROPE_FACTORS = {"short": "rope_factors_short.weight", "long": "rope_factors_long.weight"}
_BLOCK_NAME = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")


# Files whose tokenizer transformers builds but whose config it cannot read (AutoTokenizer reads both).
TOKENIZER_ONLY_ARCHITECTURES = ("gemma",)

VOCABULARY_ARRAYS = (
    "tokenizer.ggml.tokens",
    "tokenizer.ggml.token_type",
    "tokenizer.ggml.merges",
    "tokenizer.ggml.scores",
)


@functools.lru_cache(maxsize=4)
def open_gguf(path: str) -> Header:
    """The parsed header (inference/gguf_header.py), the vocabulary arrays' lengths only."""
    if not Path(path).is_file():
        raise FileNotFoundError(f"GGUF file {path} does not exist")
    return read_header(path, skipped=VOCABULARY_ARRAYS)


def metadata(path: str, key: str, default=None):
    if key in VOCABULARY_ARRAYS:
        raise KeyError(f"{key} is not kept after parsing (Header); load_tokenizer reads the vocabulary")
    return open_gguf(path).fields.get(key, default)


def architecture(path: str) -> str:
    """The HF architecture name; anything else fails here, at start-up, naming what the file holds."""
    arch = metadata(path, "general.architecture")
    if arch not in ARCHITECTURES:
        raise ValueError(
            f"unsupported GGUF architecture {arch!r} in {path}; supported: {', '.join(ARCHITECTURES)} "
            "(Mistral files use 'llama')"
        )
    if arch == "llama" and "mistral" in str(metadata(path, "general.name", "")).lower():
        return "MistralForCausalLM"  # the same rule transformers applies to GGUF files
    return ARCHITECTURES[arch]


def config_dict(path: str) -> dict:
    """The file's metadata as the keys of an HF config.json (what ModelConfig.from_dict reads)."""
    arch = metadata(path, "general.architecture")
    hf_arch = architecture(path)

    def get(key, default=None):
        return metadata(path, f"{arch}.{key}", default)

    names = {t.name for t in open_gguf(path).tensors}
    heads = get("attention.head_count")
    hidden = get("embedding_length")
    head_dim = get("attention.key_length") or hidden // heads
    eos = end_of_turn_token_ids(path)
    return {
        "architectures": [hf_arch],
        "vocab_size": get("vocab_size") or open_gguf(path).lengths["tokenizer.ggml.tokens"],
        "hidden_size": hidden,
        "intermediate_size": get("feed_forward_length"),
        "num_hidden_layers": get("block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": get("attention.head_count_kv") or heads,
        "head_dim": head_dim,
        "rms_norm_eps": get("attention.layer_norm_rms_epsilon", 1e-6),
        "rope_theta": get("rope.freq_base", 10000.0),
        "rope_scaling": _rope_scaling(path, get, names),
        "max_position_embeddings": get("context_length", 2048),
        "tie_word_embeddings": "output.weight" not in names,
        "partial_rotary_factor": get("rope.dimension_count", head_dim) / head_dim,
        "attention_bias": "blk.0.attn_q.bias" in names,
        "sliding_window": get("attention.sliding_window"),
        "use_sliding_window": get("attention.sliding_window") is not None,
        "bos_token_id": metadata(path, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": eos,
    }


def _rope_scaling(path: str, get, names: set[str]) -> dict | None:
    if ROPE_FACTORS["short"] in names:  # Phi-3's LongRoPE files: per-frequency factors, as tensors
        short = next(t for t in open_gguf(path).tensors if t.name == ROPE_FACTORS["short"])
        return {
            "rope_type": "longrope",
            "short_factor": np.asarray(short.data, dtype=np.float32).tolist(),
            "original_max_position_embeddings": get("rope.scaling.original_context_length"),
            "attention_factor": get("rope.scaling.attn_factor"),
        }
    kind = get("rope.scaling.type")
    if kind in (None, "none"):
        return None
    scaling = {"rope_type": kind, "factor": get("rope.scaling.factor", 1.0)}
    if get("rope.scaling.original_context_length"):
        scaling["original_max_position_embeddings"] = get("rope.scaling.original_context_length")
    return scaling


def end_of_turn_token_ids(path: str) -> list[int]:
    """EOS plus llama.cpp's end-of-turn / end-of-message ids (Llama 3's <|eot_id|>, <|eom_id|>)."""
    keys = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
    return sorted({int(v) for v in (metadata(path, k) for k in keys) if v is not None})


def generation_defaults(path: str) -> dict:
    """general.sampling.* (written by recent llama.cpp converters from generation_config.json)."""
    found = {field: metadata(path, f"general.sampling.{key}") for key, field in SAMPLING_KEYS.items()}
    return {field: value for field, value in found.items() if value is not None}


@functools.cache
def supported_types() -> tuple[str, ...]:
    """Every ggml type the gguf package dequantizes (Q8_1, Q8_K and the integer types it does not)."""
    from gguf.quants import _type_traits

    return FLOAT_TYPES + tuple(kind.name for kind in _type_traits if kind.name not in FLOAT_TYPES)


def check_tensor_types(path: str) -> None:
    """Every tensor must be of a type we dequantize; the error lists each other type and a tensor of it."""
    unsupported: dict[str, str] = {}
    for tensor in open_gguf(path).tensors:
        if tensor.tensor_type.name not in supported_types():
            unsupported.setdefault(tensor.tensor_type.name, tensor.name)
    if unsupported:
        found = ", ".join(f"{kind} (e.g. {name})" for kind, name in unsupported.items())
        raise ValueError(f"unsupported GGUF tensor types in {path}: {found}; supported: {', '.join(supported_types())}")


def hf_tensor_name(gguf_name: str, arch: str = "llama") -> str:
    if gguf_name in GLOBAL_TENSORS:
        return GLOBAL_TENSORS[gguf_name]
    parts = {**BLOCK_TENSORS, **ARCHITECTURE_BLOCK_TENSORS.get(arch, {})}
    match = _BLOCK_NAME.match(gguf_name)
    if match is None or match.group(2) not in parts:
        raise ValueError(f"unsupported GGUF tensor {gguf_name!r} (not part of the Llama layout)")
    layer, part, kind = match.groups()
    return f"model.layers.{layer}.{parts[part]}.{kind}"


def iter_weights(path: str, cfg, packed: bool = False) -> Iterator[tuple[str, object]]:
    """(HF name, tensor) for every tensor of the file, one at a time: float32, dequantized; or with
    `packed`, each quantized matrix as a PackedTensor of the file's blocks (llama's Q/K rows
    unpermuted block row by block row: a row of blocks is one output feature)."""
    import torch  # here, not at the top: the web tier reads metadata (sampling defaults) without torch
    from gguf.quants import dequantize

    arch = metadata(path, "general.architecture")
    header = open_gguf(path)
    for tensor in header.tensors:
        if tensor.name in ROPE_FACTORS.values():
            continue
        name = hf_tensor_name(tensor.name, arch)
        kind = tensor.tensor_type.name
        keep_blocks = packed and kind not in FLOAT_TYPES and len(tensor.data.shape) == 2
        values = tensor.data if keep_blocks else dequantize(tensor.data, tensor.tensor_type)
        if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = cfg.num_heads if "q_proj" in name else cfg.num_kv_heads
            values = unpermute_rows(values, heads)
        if arch == "gemma" and name.endswith("norm.weight"):
            values = values - 1  # llama.cpp's converter stores Gemma's 1 + w; the HF layout holds w
        loaded: object
        if keep_blocks:
            from inference.quantization.gguf import from_gguf_array

            loaded = from_gguf_array(kind, values, int(tensor.shape[0]))
        else:
            loaded = torch.from_numpy(np.array(values, dtype=np.float32))
        unmap_pages(header.data, tensor.data_offset, tensor.data_offset + tensor.n_bytes)
        yield name, loaded
    # a read maps the cached pages around it too (the kernel's fault-around), some of them tensors
    # already unmapped: once all are read, the whole data region again
    unmap_pages(header.data, header.data_offset, len(header.data))


def unmap_pages(data: np.memmap, start: int, end: int) -> None:
    """Every tensor is copied out of the file's mapping, but the pages read stay mapped while the parsed
    header is cached (open_gguf): the process's resident set would count the whole file a second time
    (4.3 GiB more for an 8B Q4_K file). MADV_DONTNEED on a read-only file mapping only unmaps them: the
    page cache keeps them, and a later read maps them again. Done per tensor, so a load never holds
    the file and its copy at once."""
    import mmap

    mapping: mmap.mmap = data._mmap  # type: ignore[attr-defined]  # np.memmap's own mmap object
    first_page = start // mmap.PAGESIZE * mmap.PAGESIZE
    mapping.madvise(mmap.MADV_DONTNEED, first_page, end - first_page)


def unpermute_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's permute(): per head, its interleaved rotary row pairs back to two halves."""
    half = weight.shape[0] // num_heads // 2
    return weight.reshape(num_heads, half, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


# ---- tokenizer ---------------------------------------------------------------------------------


def load_tokenizer(path: str):
    """The HF tokenizer transformers builds from the GGUF metadata (vocabulary, merges, chat template).

    Building it takes seconds (a 49k-token vocabulary), and the engine, the web tier and Celery
    each need it at start-up, so the result is saved once per file under the cache directory,
    keyed by a hash of the file's header (where every tokenizer field lives).
    """
    from transformers import AutoTokenizer

    cached = tokenizer_cache_dir(path)
    if (cached / "tokenizer_config.json").exists():
        return AutoTokenizer.from_pretrained(str(cached))
    file = Path(path)
    if metadata(path, "general.architecture") in TOKENIZER_ONLY_ARCHITECTURES:
        from transformers import PreTrainedTokenizerFast

        tokenizer = PreTrainedTokenizerFast.from_pretrained(str(file.parent), gguf_file=file.name)
    else:
        tokenizer = AutoTokenizer.from_pretrained(str(file.parent), gguf_file=file.name)
    try:
        _save_atomically(tokenizer, cached)
    except OSError as exc:  # a read-only home: correct, only slower at the next start
        logger.warning("could not cache the GGUF tokenizer in %s (%s); set TESSERA_CACHE_DIR", cached, exc)
    return tokenizer


def tokenizer_cache_dir(path: str) -> Path:
    header = open_gguf(path).data_offset
    with open(path, "rb") as f:
        digest = hashlib.sha256(f.read(header)).hexdigest()[:20]
    return cache_root() / "gguf-tokenizers" / f"{Path(path).stem}-{digest}"


def cache_root() -> Path:
    """TESSERA_CACHE_DIR (`make run` sets var/cache), else ~/.cache/tessera; never the checkout."""
    return Path(os.environ.get("TESSERA_CACHE_DIR") or Path.home() / ".cache" / "tessera")


def _save_atomically(tokenizer, target: Path) -> None:
    """Processes that start together may all build it; the first rename wins, the rest are dropped."""
    import shutil
    import tempfile

    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=target.name + ".", dir=target.parent))
    tokenizer.save_pretrained(str(staging))
    try:
        staging.rename(target)
    except OSError:  # another process got there first
        shutil.rmtree(staging, ignore_errors=True)
