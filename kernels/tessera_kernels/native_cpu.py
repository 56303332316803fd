"""CPU kernels in C, for the hot path that torch cannot do without copies.

- csrc/decode_attention.c: paged decode attention. In torch it must first gather every
  sequence's K/V out of the paged cache into a padded batch (write it, then read it again); the
  C kernel reads the blocks in place.
- csrc/prefill_attention.c: paged prefill attention (flash attention over the blocks in place, in
  tiles of query rows sized for the vector registers), where torch runs one SDPA per sequence on a
  gathered copy at a fraction of the GEMMs' speed.
- csrc/elementwise.c: residual add + RMSNorm, SiLU-and-multiply and rotary, one pass each where
  torch runs a chain of operators with a temporary per step; and the K/V store into the caches.
- csrc/quant_gemm.c: linear layers on GGUF block-format weights (int8 activations, integer dot
  products) and the dequantized gather of their rows; wrapped by kernels/tessera_kernels/quant_cpu.py.

The library is compiled on first use with the system C compiler (`cc`, or $CC) for this
machine's CPU and cached under $TESSERA_KERNEL_CACHE (default ~/.cache/tessera/kernels). When
there is no compiler, or TESSERA_NATIVE_KERNELS=0, `load()` returns None and the engine keeps
the torch reference. Each wrapper below has the signature of its torch_ref twin; `supports*`
says which inputs it takes (float32 and bfloat16 on CPU), the torch backend routes the rest to
the reference.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

CSRC = Path(__file__).parent / "csrc"
SOURCES = [CSRC / "decode_attention.c", CSRC / "prefill_attention.c", CSRC / "elementwise.c", CSRC / "quant_gemm.c"]
HEADERS = [CSRC / "bf16.h", CSRC / "vec.h"]
# -ffast-math lets gcc vectorise the dot products and call glibc's vector expf; the kernel never
# relies on infinities or NaNs (softmax starts from the first score, not -inf). Compile only: linked
# with -ffast-math, gcc 12 adds crtfastmath.o, which turns on flush-to-zero for the whole process
# that loads the library (every float op of torch, numpy and hypothesis in it, not just this kernel).
# gcc keeps to 256-bit vectors on AVX-512 machines unless told: 512-bit loops and libmvec's 16-wide
# expf are faster (docs/kernels.md; x86 only: other targets lack the flag).
# -Wno-psabi: vec.h's 64-byte vectors on a target without AVX-512 (the portable build) make gcc warn
# that such arguments would pass differently across a call; its helpers are always inlined.
COMPILE_FLAGS = [
    "-O3",
    "-march=native",
    *(["-mprefer-vector-width=512"] if platform.machine() in ("x86_64", "AMD64") else []),
    "-ffast-math",
    "-fopenmp",
    "-fPIC",
    "-Wno-psabi",
]
LINK_FLAGS = ["-shared", "-fopenmp"]
SUPPORTED_DTYPES = {torch.float32: 0, torch.bfloat16: 1}


def cache_dir() -> Path:
    default = Path.home() / ".cache" / "tessera" / "kernels"
    return Path(os.environ.get("TESSERA_KERNEL_CACHE") or default)


@functools.cache
def _cpuinfo() -> list[str]:
    """The first CPU's model name and flags lines from Linux's /proc/cpuinfo (none elsewhere)."""
    try:
        with open("/proc/cpuinfo") as f:
            return [ln for ln in f if ln.startswith(("model name", "flags"))][:2]
    except OSError:
        return []


def _cpu_id() -> str:
    """-march=native code is only valid on the CPU that built it: the cache key names the CPU."""
    return platform.machine() + "".join(_cpuinfo())


def _compile(compiler: str, extra_flags: tuple[str, ...] = ()) -> Path:
    compile_flags = [*COMPILE_FLAGS, *extra_flags]
    source = b"".join(path.read_bytes() for path in SOURCES + HEADERS)
    key = hashlib.sha256(source + " ".join([compiler, *compile_flags, *LINK_FLAGS, _cpu_id()]).encode()).hexdigest()[
        :16
    ]
    target = cache_dir() / f"native-{key}.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        # Build beside the target, then rename: processes that build at once never see half a file.
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
        os.close(fd)
        objects = [f"{tmp}.{path.stem}.o" for path in SOURCES]
        try:
            for path, obj in zip(SOURCES, objects):
                subprocess.run([compiler, *compile_flags, "-c", str(path), "-o", obj], check=True, capture_output=True)
            subprocess.run([compiler, *LINK_FLAGS, *objects, "-o", tmp, "-lm"], check=True, capture_output=True)
            os.replace(tmp, target)
        finally:
            for leftover in (tmp, *objects):
                if os.path.exists(leftover):
                    os.unlink(leftover)
    return target


def open_library(path: Path):
    """ctypes handle with every kernel's argument types declared."""
    lib = ctypes.CDLL(str(path))
    ptr, i64, i32, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
    declared = {
        "paged_decode_attention": [ptr] * 4 + [i64, ptr, ptr] + [i32] * 6 + [f32, i32, i64],
        "paged_prefill_attention": [ptr, i64, ptr, ptr, ptr, i64, ptr, ptr, ptr] + [i32] * 6 + [f32, i32],
        "fused_add_rms_norm": [ptr] * 5 + [i64, i32, f32, i32, i32],
        "silu_and_mul": [ptr, ptr, i64, i32, i32, i32],
        "rotary_embedding": [ptr, ptr, i64, i32, ptr, i64, i32, ptr, i64, i32, i32, i32],
        "store_kv_cache": [ptr, i64, ptr, i64, ptr, ptr, ptr, i64, i64, i64],
        "gguf_supported": [i32],
        "gguf_fused": [i32, i64],
        "gguf_x16": [i32],
        "gguf_to_x16": [i32, ptr, ptr, i64, i64, i32],
        "gguf_linear": [ptr, i64, i64, i64, ptr, i64, i64, i32, ptr, ptr, i64, i32, i32],
        "gguf_tiles": [i32, i64],
        "gguf_tile_linear": [ptr, i64, i64, i64, ptr, i64, i64, i32, ptr, ptr, i64, i32, i32],
        "gguf_dequantize_rows": [ptr, i64, i64, i32, ptr, i64, i64, ptr, i32, i32],
    }
    returns = {
        "paged_decode_attention": ctypes.c_int,
        "paged_prefill_attention": ctypes.c_int,
        "store_kv_cache": i64,
        "gguf_supported": ctypes.c_int,
        "gguf_fused": ctypes.c_int,
        "gguf_x16": ctypes.c_int,
        "gguf_to_x16": ctypes.c_int,
        "gguf_linear": ctypes.c_int,
        "gguf_tiles": ctypes.c_int,
        "gguf_tile_linear": ctypes.c_int,
        "gguf_dequantize_rows": ctypes.c_int,
    }
    for name, argtypes in declared.items():
        fn = getattr(lib, name)
        fn.argtypes = argtypes
        fn.restype = returns.get(name)
    return lib


@functools.cache
def load():
    """The compiled library, or None when native kernels are off or cannot be built here."""
    if os.environ.get("TESSERA_NATIVE_KERNELS", "1") == "0":
        return None
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        return None
    try:
        return open_library(_compile(compiler))
    except (OSError, subprocess.CalledProcessError):
        return None


_capture = threading.local()  # per thread: engines in threads of one process capture apart


class Recorder:
    """Stands in for the library while a decode step is captured (inference/decode_graph.py): each
    call runs as usual and is kept, with its arguments and what it returned, to be made again."""

    def __init__(self, library):
        self.library = library
        self.calls: list[tuple[Callable[..., Any], tuple, Any]] = []

    def __getattr__(self, name):
        function = getattr(self.library, name)

        def recorded(*args):
            result = function(*args)
            self.calls.append((function, args, result))
            return result

        return recorded


@contextlib.contextmanager
def recording():
    """While inside, this thread's kernel calls through active_library() are recorded; yields the Recorder."""
    recorder = Recorder(load())
    _capture.recorder = recorder
    try:
        yield recorder
    finally:
        _capture.recorder = None


def active_library():
    """load(), or this thread's Recorder while a step is being captured."""
    return getattr(_capture, "recorder", None) or load()


def supports(q, k_cache) -> bool:
    return q.device.type == "cpu" and q.dtype == k_cache.dtype and q.dtype in SUPPORTED_DTYPES


def paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale, library=None, out=None):
    """Same meaning as torch_ref.paged_decode_attention; `library` defaults to load(); `out` (contiguous,
    q's shape) receives the result when given."""
    batch, num_heads, head_dim = q.shape
    if not (q.stride(2) == 1 and q.stride(1) == head_dim):  # rows may be apart (views of the QKV output)
        q = q.contiguous()
    block_tables = block_tables.to(torch.int32).contiguous()
    seq_lens = seq_lens.to(torch.int32).contiguous()
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("the paged caches must be contiguous")
    out = torch.empty(q.shape, dtype=q.dtype) if out is None else out
    if batch == 0:
        return out
    status = (library or active_library()).paged_decode_attention(
        q.data_ptr(),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        block_tables.data_ptr(),
        block_tables.shape[1],
        seq_lens.data_ptr(),
        out.data_ptr(),
        batch,
        num_heads,
        k_cache.shape[2],
        head_dim,
        k_cache.shape[1],
        SUPPORTED_DTYPES[q.dtype],
        scale,
        torch.get_num_threads(),
        q.stride(0),
    )
    if status:
        raise MemoryError("native decode attention could not allocate its scratch memory")
    return out


MAX_PREFILL_GROUP = 8  # query heads per KV head that the prefill kernel's tiles hold


def supports_prefill(q, k_cache) -> bool:
    """[T, Hq, D] queries whose heads are contiguous within a token, D a multiple of 16."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    return (
        supports(q, k_cache)
        and head_dim % 16 == 0
        and q.stride(2) == 1
        and q.stride(1) == head_dim
        and num_heads // k_cache.shape[2] <= MAX_PREFILL_GROUP
    )


def paged_prefill_attention(
    q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale, library=None, out=None
):
    """Same meaning as torch_ref.paged_prefill_attention; `library` defaults to load(); `out` as in
    paged_decode_attention."""
    block_tables = block_tables.to(torch.int32).contiguous()
    query_start_loc = query_start_loc.to(torch.int32).contiguous()
    seq_lens = seq_lens.to(torch.int32).contiguous()
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("the paged caches must be contiguous")
    out = torch.empty(q.shape, dtype=q.dtype) if out is None else out
    if q.shape[0] == 0:
        return out
    status = (library or active_library()).paged_prefill_attention(
        q.data_ptr(),
        q.stride(0),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        block_tables.data_ptr(),
        block_tables.shape[1],
        query_start_loc.data_ptr(),
        seq_lens.data_ptr(),
        out.data_ptr(),
        seq_lens.shape[0],
        q.shape[1],
        k_cache.shape[2],
        q.shape[2],
        k_cache.shape[1],
        SUPPORTED_DTYPES[q.dtype],
        scale,
        torch.get_num_threads(),
    )
    if status:
        raise MemoryError("native prefill attention could not allocate its scratch memory")
    return out


def supports_rows(*tensors) -> bool:
    """The elementwise kernels: CPU, one float32 or bfloat16 dtype, innermost dimension contiguous."""
    first = tensors[0]
    return (
        all(t.device.type == "cpu" and t.dtype == first.dtype and t.stride(-1) == 1 for t in tensors)
        and first.dtype in SUPPORTED_DTYPES
    )


def fused_add_rms_norm(x, residual, weight, eps, library=None, out=None):
    """Same meaning as torch_ref.fused_add_rms_norm: returns (normed, x + residual); `out` (contiguous,
    x's shape) receives normed when given."""
    x = x.contiguous()
    new_residual = x if residual is None else torch.empty_like(x)
    out = torch.empty_like(x) if out is None else out
    (library or active_library()).fused_add_rms_norm(
        x.data_ptr(),
        None if residual is None else residual.contiguous().data_ptr(),
        new_residual.data_ptr(),
        weight.contiguous().data_ptr(),
        out.data_ptr(),
        x.numel() // x.shape[-1],
        x.shape[-1],
        eps,
        SUPPORTED_DTYPES[x.dtype],
        torch.get_num_threads(),
    )
    return out, new_residual


def silu_and_mul(x, library=None, out=None):
    """Same meaning as torch_ref.silu_and_mul: [..., 2I] -> [..., I]; `out` (contiguous) receives it when given."""
    x = x.contiguous()
    inter = x.shape[-1] // 2
    out = x.new_empty(*x.shape[:-1], inter) if out is None else out
    (library or active_library()).silu_and_mul(
        x.data_ptr(),
        out.data_ptr(),
        x.numel() // x.shape[-1],
        inter,
        SUPPORTED_DTYPES[x.dtype],
        torch.get_num_threads(),
    )
    return out


def supports_rotary(q, k, cos_sin_cache) -> bool:
    """Whole-head rotation of [T, H, D] views whose heads are contiguous within a row."""
    head_dim = q.shape[-1]
    return (
        supports_rows(q, k)
        and cos_sin_cache.dtype == torch.float32
        and cos_sin_cache.is_contiguous()
        and cos_sin_cache.shape[-1] == head_dim
        and all(t.stride(1) == head_dim for t in (q, k))
    )


def rotary_embedding(positions, q, k, cos_sin_cache, library=None) -> None:
    """Same meaning as torch_ref.rotary_embedding: rotates q and k in place."""
    positions = positions.to(torch.int64).contiguous()
    (library or active_library()).rotary_embedding(
        positions.data_ptr(),
        q.data_ptr(),
        q.stride(0),
        q.shape[1],
        k.data_ptr(),
        k.stride(0),
        k.shape[1],
        cos_sin_cache.data_ptr(),
        q.shape[0],
        q.shape[-1],
        SUPPORTED_DTYPES[q.dtype],
        torch.get_num_threads(),
    )


def supports_store(k, v, k_cache, v_cache) -> bool:
    """[T, Hkv, D] rows whose heads are contiguous (views into the QKV output), in the caches' dtype."""
    rows_ok = all(
        t.device.type == "cpu"
        and t.dtype == k_cache.dtype
        and t.stride(-1) == 1
        and t.stride(-2) == t.shape[-1]
        and t.shape[1:] == k_cache.shape[2:]
        for t in (k, v)
    )
    caches_ok = k_cache.is_contiguous() and v_cache.is_contiguous() and v_cache.shape == k_cache.shape
    return rows_ok and caches_ok and v_cache.dtype == k_cache.dtype and k.shape[0] == v.shape[0]


def store_kv_cache(k, v, k_cache, v_cache, slot_mapping, library=None) -> None:
    """Same meaning as torch_ref.store_kv_cache: k, v [T, Hkv, D] into the caches at slot_mapping."""
    slot_mapping = slot_mapping.to(torch.int64).contiguous()
    element = k.element_size()
    num_slots = k_cache.shape[0] * k_cache.shape[1]
    bad = (library or active_library()).store_kv_cache(
        k.data_ptr(),
        k.stride(0) * element,
        v.data_ptr(),
        v.stride(0) * element,
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        slot_mapping.data_ptr(),
        k.shape[0],
        k.shape[1] * k.shape[2] * element,
        num_slots,
    )
    if bad >= 0:
        raise IndexError(f"slot {int(slot_mapping[bad])} of token {bad} is past the cache's {num_slots} slots")
