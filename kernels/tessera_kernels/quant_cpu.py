"""Linear layers and row gathers on GGUF block-format weights, in C (csrc/quant_gemm.c).

A packed weight is the file's bytes, [rows, row_bytes] uint8, and its ggml type; on AVX-512 VNNI machines
the common types' rows are interleaved at load 16 to a group (`kernel_layout`: kind "Q4_1x16", "Q4_Kx16",
the same bytes in another order), which their fused kernels read. The product quantizes the activations
to int8 per block (`activation_block`: 32 values, or 256 for the interleaved K-quants, as llama.cpp's
Q8_K) and runs integer dot products against the weight's codes (AVX-512 VNNI, AVX2, or plain C);
`reference_linear` is its meaning (the weight dequantized by the gguf package, then a float matmul). The
int8 activations make the result differ from the reference by at most sum_i |w_i| * max|x| of i's block /
254 (half a step of the activation's quantization), which the tests check per output.

With more activation rows `linear` leaves the integer kernel where another path measured faster
(docs/kernels.md, `path`): on CPUs with AMX, interleaved rows go to bfloat16 tiles from TILES_FROM_ROWS
(`tile_linear`: a chunk of weight groups dequantized in the C kernel, then met by every activation row);
rows in the file's order go to oneDNN's bfloat16 GEMM on the weight dequantized a slice of rows at a
time into a reused per-thread buffer (`dequantized_linear`). The weight stays packed in memory either
way. Their error against the reference is bfloat16 rounding: at most 2^-7 of sum_i |w_i x_i| (weight and
activation rounded) plus 2^-8 of the output.

KERNEL_TYPES have kernels; other ggml types are converted at load (inference/quantization/gguf.py).
"""

from __future__ import annotations

import functools
import threading

import numpy as np
import torch

from tessera_kernels import native_cpu

KERNEL_TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
X16 = "x16"  # a kind's suffix when its rows are interleaved 16 to a group (kernel_layout)
X16_FLAG = 0x100  # added to the ggml type number of such a kind (csrc/quant_gemm.c)
# Activation rows from which another path is faster, measured (docs/kernels.md). The decoded path's kernel:
# oneDNN on the dequantized weight from 32 rows. Interleaved rows: AMX's tiles from 32 rows where the library
# has them, decode and prefill rows alike, and the integer kernel at every count without (there it beats
# oneDNN up to 2048 rows, max_num_batched_tokens' default). Both give a row the same bits at any count, so
# a prompt chunked otherwise by a speculating engine than by a plain one changes path only where a chunk
# crosses TILES_FROM_ROWS.
DEQUANTIZE_FROM_ROWS = 32
TILES_FROM_ROWS = 32
SCRATCH_VALUES = 1 << 23  # weight values dequantized at once (16 MiB of bfloat16): larger weights go in slices
_scratch = threading.local()  # one buffer per thread: engines in threads of one process never share it


def type_number(name: str) -> int:
    from gguf import GGMLQuantizationType

    return int(GGMLQuantizationType[file_kind(name)]) | (X16_FLAG if name.endswith(X16) else 0)


def file_kind(kind: str) -> str:
    """The ggml type whose blocks `kind` holds, in the file's order or interleaved."""
    return kind.removesuffix(X16)


def block_values(name: str) -> int:
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    return GGML_QUANT_SIZES[GGMLQuantizationType[file_kind(name)]][0]


def kernel_kind(kind: str, library=None) -> str:
    """The kind a matrix of `kind` is held as: interleaved (kind + X16: rows 16 to a group) where the library
    has that fused kernel (AVX-512 VNNI), else `kind`."""
    library = library or native_cpu.load()
    if library is None or kind.endswith(X16) or not library.gguf_x16(type_number(kind)):
        return kind
    return kind + X16


def kernel_layout(
    kind: str, packed: torch.Tensor, in_features: int, library=None, in_place: bool = False
) -> tuple[str, torch.Tensor]:
    """(kernel_kind, blocks in that layout): a new tensor, or `packed` itself rewritten (in_place: a load's
    own copy, so a large table is not held twice)."""
    held = kernel_kind(kind, library)
    if held == kind:
        return kind, packed
    return held, _reorder(library or native_cpu.load(), kind, packed, in_features, True, in_place)


def file_layout(kind: str, packed: torch.Tensor, in_features: int, library=None) -> tuple[str, torch.Tensor]:
    """(kind, blocks) in the file's order: kernel_layout undone, in a new tensor."""
    if not kind.endswith(X16):
        return kind, packed
    return file_kind(kind), _reorder(library or native_cpu.load(), file_kind(kind), packed, in_features, False, False)


def _reorder(library, kind: str, packed: torch.Tensor, in_features: int, to_x16: bool, in_place: bool) -> torch.Tensor:
    if not packed.is_contiguous():
        raise ValueError("packed blocks must be contiguous")
    out = packed if in_place else torch.empty_like(packed)
    rows = packed.shape[0]
    status = library.gguf_to_x16(type_number(kind), packed.data_ptr(), out.data_ptr(), rows, in_features, to_x16)
    _check(status, kind, in_features)
    return out


@functools.cache  # asked on every packed linear call: the answer per weight shape never changes
def fused(kind: str, in_features: int, library=None) -> bool:
    """Whether this weight runs on an interleaved type's integer kernel (AVX-512 VNNI)."""
    return bool((library or native_cpu.load()).gguf_fused(type_number(kind), in_features))  # load(): never recorded


@functools.cache
def tiles(kind: str, in_features: int, library=None) -> bool:
    """Whether this weight has the AMX tile kernel (interleaved rows on a CPU with AMX)."""
    return bool((library or native_cpu.load()).gguf_tiles(type_number(kind), in_features))


def path(kind: str, in_features: int, rows: int, library=None) -> str:
    """Which kernel `linear` runs for `rows` activation rows ("integer", "tiles" or "dequantized")."""
    if not fused(kind, in_features, library):
        return "integer" if rows < DEQUANTIZE_FROM_ROWS else "dequantized"
    return "tiles" if rows >= TILES_FROM_ROWS and tiles(kind, in_features, library) else "integer"


def leaves_integer_at(kind: str, in_features: int, library=None) -> int | None:
    """The fewest rows for which `linear` leaves the integer kernel for this weight (None: never)."""
    if not fused(kind, in_features, library):
        return DEQUANTIZE_FROM_ROWS
    return TILES_FROM_ROWS if tiles(kind, in_features, library) else None


def activation_block(kind: str, in_features: int, library=None) -> int:
    """Values per int8 scale of the activations that `integer_linear` multiplies with this weight."""
    return 256 if block_values(kind) == 256 and fused(kind, in_features, library) else 32


def supports(x: torch.Tensor) -> bool:
    return x.device.type == "cpu" and x.dtype in native_cpu.SUPPORTED_DTYPES and native_cpu.load() is not None


def linear(
    x: torch.Tensor,
    packed: torch.Tensor,
    kind: str,
    in_features: int,
    bias: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    library=None,
    decode_rows: int = 0,
) -> torch.Tensor:
    """x [m, in] @ W.T (+ bias) with W the [out, row_bytes] uint8 blocks of type `kind`; the result in
    x's dtype, written into `out` ([m, out] with unit column stride; a column slice is fine) when given.
    The first `decode_rows` rows are a step's decodes (laid out ahead of its prefill chunks): each part
    runs `path`'s kernel for its own count, apart from the other unless both take the same kernel and it
    gives a row the same bits at any count (the integer kernel, the tiles), so a decode row's bits never
    depend on a chunk that shares its step."""
    rows = x.shape[0]
    decode_rows = min(decode_rows, rows)
    decode = path(kind, in_features, decode_rows, library) if decode_rows else "integer"
    rest = path(kind, in_features, rows - decode_rows, library) if rows > decode_rows else "integer"
    kernels = {"integer": integer_linear, "tiles": tile_linear, "dequantized": dequantized_linear}
    if decode == rest != "dequantized":  # one call: the weight dequantized once for tiles, read once
        return kernels[decode](x, packed, kind, in_features, bias, out, library)
    if 0 < decode_rows < rows:
        out = x.new_empty(rows, packed.shape[0]) if out is None else out
        for part, count in ((slice(0, decode_rows), decode_rows), (slice(decode_rows, None), 0)):
            linear(x[part], packed, kind, in_features, bias, out[part], library, count)
        return out
    return kernels[decode if decode_rows else rest](x, packed, kind, in_features, bias, out, library)


def integer_linear(
    x: torch.Tensor,
    packed: torch.Tensor,
    kind: str,
    in_features: int,
    bias: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    library=None,
) -> torch.Tensor:
    """`linear` by the C kernel: int8 activations, integer dot products against the blocks' codes."""
    return _native_linear("gguf_linear", x, packed, kind, in_features, bias, out, library)


def tile_linear(
    x: torch.Tensor,
    packed: torch.Tensor,
    kind: str,
    in_features: int,
    bias: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    library=None,
) -> torch.Tensor:
    """`linear` on AMX's bfloat16 tiles (where `tiles` says so): each group of 16 weight rows dequantized in
    registers and met by every activation row, float32 sums."""
    return _native_linear("gguf_tile_linear", x, packed, kind, in_features, bias, out, library)


def _native_linear(entry: str, x, packed, kind, in_features, bias, out, library) -> torch.Tensor:
    if x.stride(-1) != 1:
        x = x.contiguous()
    rows = packed.shape[0]
    out = x.new_empty(x.shape[0], rows) if out is None else out
    if bias is not None:
        bias = bias.to(x.dtype).contiguous()
    status = getattr(library or native_cpu.active_library(), entry)(
        x.data_ptr(),
        x.stride(0),
        x.shape[0],
        in_features,
        packed.data_ptr(),
        packed.shape[1],
        rows,
        type_number(kind),
        None if bias is None else bias.data_ptr(),
        out.data_ptr(),
        out.stride(0),
        native_cpu.SUPPORTED_DTYPES[x.dtype],
        torch.get_num_threads(),
    )
    _check(status, kind, in_features)
    return out


def dequantized_linear(
    x: torch.Tensor,
    packed: torch.Tensor,
    kind: str,
    in_features: int,
    bias: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    library=None,
) -> torch.Tensor:
    """`linear` through bfloat16: SCRATCH_VALUES of the weight at a time dequantized into this thread's
    buffer, then oneDNN's GEMM on it; nothing dequantized outlives the call."""
    rows = packed.shape[0]
    out = x.new_empty(x.shape[0], rows) if out is None else out
    activations = x.to(torch.bfloat16)
    slices = -(-rows * in_features // SCRATCH_VALUES)
    step = -(-rows // slices)  # slices of one size: a GEMM of a few rows left over costs as much as a full one
    buffer = scratch(step * in_features)
    for start in range(0, rows, step):
        end = min(start + step, rows)
        weight = buffer[: (end - start) * in_features].view(end - start, in_features)
        dequantize_rows(packed, kind, torch.arange(start, end), in_features, torch.bfloat16, library, out=weight)
        if bias is None and slices == 1 and out.dtype == torch.bfloat16 and out.is_contiguous():
            torch.mm(activations, weight.t(), out=out)  # straight into the output: no copy
            continue
        part = torch.nn.functional.linear(activations, weight)
        if bias is None:
            out[:, start:end].copy_(part)
        else:  # the bias added in the output's dtype, not rounded to bfloat16 first
            torch.add(part, bias[start:end].to(out.dtype), out=out[:, start:end])
    return out


def scratch(values: int) -> torch.Tensor:
    """This thread's bfloat16 buffer of at least `values` elements (grown, never shrunk)."""
    buffer = getattr(_scratch, "buffer", None)
    if buffer is None or buffer.numel() < values:
        buffer = _scratch.buffer = torch.empty(values, dtype=torch.bfloat16)
    return buffer


def dequantize_rows(
    packed: torch.Tensor,
    kind: str,
    ids: torch.Tensor,
    in_features: int,
    dtype=torch.float32,
    library=None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Rows `ids` of the packed weight, dequantized: [len(ids), in_features] in `dtype`, written into
    `out` (contiguous, that shape and dtype) when given."""
    ids = ids.reshape(-1).to(torch.int64).contiguous()
    if out is None:
        out = torch.empty(ids.shape[0], in_features, dtype=dtype)
    elif out.shape != (ids.shape[0], in_features) or out.dtype != dtype or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous [{ids.shape[0]}, {in_features}] {dtype} tensor")
    status = (library or native_cpu.active_library()).gguf_dequantize_rows(
        packed.data_ptr(),
        packed.shape[1],
        packed.shape[0],
        type_number(kind),
        ids.data_ptr(),
        ids.shape[0],
        in_features,
        out.data_ptr(),
        native_cpu.SUPPORTED_DTYPES[dtype],
        torch.get_num_threads(),
    )
    _check(status, kind, in_features)
    return out


def _check(status: int, kind: str, in_features: int) -> None:
    if status == -1:
        raise ValueError(f"no packed kernel for {kind} rows of {in_features} values")
    if status == -2:
        raise MemoryError("the packed GGUF kernel could not allocate its scratch memory")
    if status == -3:
        raise IndexError("a row id is outside the packed table")


def reference_linear(x: torch.Tensor, packed: torch.Tensor, kind: str, bias: torch.Tensor | None = None):
    """The meaning of `linear`: the gguf package's dequantization, then a float32 matmul."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    kind, packed = file_layout(kind, packed, x.shape[1])
    weight = torch.from_numpy(np.ascontiguousarray(dequantize(packed.numpy(), GGMLQuantizationType[kind])))
    out = x.float() @ weight.float().T
    return out if bias is None else out + bias.float()
