"""A random-weight GGUF file in Llama-3-8B's shape, every matrix Q4_K (issue 32): what loading and serving
an 8B model costs in time and memory, without downloading one (`make bench ARGS="gguf --models llama3-8b-shape
--weights packed"`).

The gguf package cannot quantize K-quants, so the blocks are random bytes with small f16 scales. The
tokenizer is the bundled SmolLM2 file's, its token list padded to Llama-3's 128256 entries. Tensors are
generated and written one at a time: the largest (token_embd, output) is about 300 MB, the file about 4.5 GB.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

FILE = Path.home() / ".cache" / "tessera-models" / "random-llama3-8b-shape-q4_k.gguf"
Q4_K_BLOCK = (256, 144)  # values and bytes per block
# d = 1e-3 and dmin = 7.5e-3 as f16 in each block's first 4 bytes (random bytes there would give f16 values
# up to 65504, infinities and NaNs); with random 6-bit scales and mins the weights come out centred, |w| < 1.
Q4_K_SCALES = np.frombuffer(np.array([1e-3, 7.5e-3], dtype=np.float16).tobytes(), dtype=np.uint8)


@dataclass(frozen=True)
class Shape:
    layers: int = 32
    hidden: int = 4096
    intermediate: int = 14336
    heads: int = 32
    kv_heads: int = 8
    vocab: int = 128256
    context: int = 8192
    rope_theta: float = 500000.0
    rms_eps: float = 1e-5

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


LLAMA3_8B = Shape()


def ensure(path: Path = FILE, shape: Shape = LLAMA3_8B) -> Path:
    """The file, written once: later runs reuse it."""
    if not path.exists():
        print(f"writing {path} (once)", flush=True)
        write(path, shape)
    return path


def write(path: Path, shape: Shape, seed: int = 0) -> Path:
    """Written under a temporary name and renamed at the end, so an interrupted write is never taken for the file."""
    from gguf import GGUFWriter

    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f"{path.name}.{os.getpid()}.partial")
    writer = GGUFWriter(str(partial), "llama")
    try:
        add_metadata(writer, shape)
        copy_tokenizer(writer, shape.vocab)
        for name, dims in tensor_shapes(shape):  # the header lists every tensor before any data
            add_tensor_info(writer, name, dims)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        rng = np.random.default_rng(seed)
        for _, dims in tensor_shapes(shape):
            writer.write_tensor_data(tensor_data(rng, dims))
        writer.close()
        partial.rename(path)
    finally:  # an interrupted write leaves no 4.5 GB behind
        writer.close()
        partial.unlink(missing_ok=True)
    return path


def add_metadata(writer, shape: Shape) -> None:
    from gguf import LlamaFileType

    writer.add_name("random Llama-3-8B shape")
    writer.add_block_count(shape.layers)
    writer.add_context_length(shape.context)
    writer.add_embedding_length(shape.hidden)
    writer.add_feed_forward_length(shape.intermediate)
    writer.add_head_count(shape.heads)
    writer.add_head_count_kv(shape.kv_heads)
    writer.add_rope_dimension_count(shape.head_dim)
    writer.add_rope_freq_base(shape.rope_theta)
    writer.add_layer_norm_rms_eps(shape.rms_eps)
    writer.add_vocab_size(shape.vocab)
    writer.add_file_type(LlamaFileType.MOSTLY_Q4_K_S)  # Q4_K throughout
    writer.add_quantization_version(2)


def copy_tokenizer(writer, vocab: int) -> None:
    """The bundled SmolLM2 file's tokenizer.* fields, its 49152 tokens padded to `vocab`.

    The padding is marked UNUSED, not CONTROL as in Llama-3's files: transformers' GGUF conversion adds
    every CONTROL token as a special token, and with 79k of them the tokenizer our loader saves takes 2.8 s
    instead of 0.4 s to load at every start. UNUSED ones stay plain vocabulary entries no merge produces.
    """
    from gguf import GGUFReader, GGUFValueType, TokenType

    from benchmarks.common import real_model_path

    source = GGUFReader(real_model_path())
    for key, field in source.fields.items():
        if not key.startswith("tokenizer."):
            continue
        value = field.contents()
        if key == "tokenizer.ggml.tokens":
            value += [f"<|reserved_special_token_{i}|>" for i in range(vocab - len(value))]
        elif key == "tokenizer.ggml.token_type":
            value += [TokenType.UNUSED] * (vocab - len(value))
        is_array = field.types[0] == GGUFValueType.ARRAY
        writer.add_key_value(key, value, field.types[0], sub_type=field.types[-1] if is_array else None)


def tensor_shapes(shape: Shape) -> Iterator[tuple[str, tuple[int, ...]]]:
    """(GGUF name, [rows, columns] or [n]) in llama.cpp's order; Q/K/V rows are output features."""
    hidden, kv = shape.hidden, shape.kv_heads * shape.head_dim
    yield "token_embd.weight", (shape.vocab, hidden)
    for i in range(shape.layers):
        yield f"blk.{i}.attn_norm.weight", (hidden,)
        yield f"blk.{i}.attn_q.weight", (hidden, hidden)
        yield f"blk.{i}.attn_k.weight", (kv, hidden)
        yield f"blk.{i}.attn_v.weight", (kv, hidden)
        yield f"blk.{i}.attn_output.weight", (hidden, hidden)
        yield f"blk.{i}.ffn_norm.weight", (hidden,)
        yield f"blk.{i}.ffn_gate.weight", (shape.intermediate, hidden)
        yield f"blk.{i}.ffn_up.weight", (shape.intermediate, hidden)
        yield f"blk.{i}.ffn_down.weight", (hidden, shape.intermediate)
    yield "output_norm.weight", (hidden,)
    yield "output.weight", (shape.vocab, hidden)


def tensor_bytes(dims: tuple[int, ...]) -> int:
    """F32 for a norm, Q4_K for a matrix."""
    return dims[0] * 4 if len(dims) == 1 else dims[0] * dims[1] // Q4_K_BLOCK[0] * Q4_K_BLOCK[1]


def add_tensor_info(writer, name: str, dims: tuple[int, ...]) -> None:
    from gguf import GGMLQuantizationType

    if len(dims) == 1:
        writer.add_tensor_info(name, dims, np.dtype(np.float32), tensor_bytes(dims))
    else:  # given as [rows, bytes per row]
        rows = dims[0]
        size = tensor_bytes(dims)
        writer.add_tensor_info(name, (rows, size // rows), np.dtype(np.uint8), size, GGMLQuantizationType.Q4_K)


def tensor_data(rng: np.random.Generator, dims: tuple[int, ...]) -> np.ndarray:
    """Norms are ones; a matrix is random Q4_K blocks (the generator's raw 64-bit words: 7x faster than
    integers(0, 256) for the 4.5 GB)."""
    if len(dims) == 1:
        return np.ones(dims, dtype=np.float32)
    rows, cols = dims
    count = rows * cols // Q4_K_BLOCK[0]
    blocks = rng.bit_generator.random_raw(count * Q4_K_BLOCK[1] // 8).view(np.uint8).reshape(count, Q4_K_BLOCK[1])
    blocks[:, :4] = Q4_K_SCALES
    return blocks
