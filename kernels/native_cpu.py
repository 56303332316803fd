"""CPU kernels in C, for the hot path that torch cannot do without copies.

Paged decode attention in torch must first gather every sequence's K/V out of the paged cache
into a padded batch (write it, then read it again); the C kernel in csrc/decode_attention.c
reads the blocks in place. It is compiled on first use with the system C compiler (`cc`, or
$CC) for this machine's CPU and cached under $TESSERA_KERNEL_CACHE (default
~/.cache/tessera/kernels). When there is no compiler, or TESSERA_NATIVE_KERNELS=0, `load()`
returns None and the engine keeps the torch reference.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

SOURCE = Path(__file__).parent / "csrc" / "decode_attention.c"
# -ffast-math lets gcc vectorise the dot products and call glibc's vector expf; the kernel never
# relies on infinities or NaNs (softmax starts from the first score, not -inf). Compile only: linked
# with -ffast-math, gcc 12 adds crtfastmath.o, which turns on flush-to-zero for the whole process
# that loads the library (every float op of torch, numpy and hypothesis in it, not just this kernel).
# gcc keeps to 256-bit vectors on AVX-512 machines unless told: 512-bit loops and libmvec's 16-wide
# expf made the kernel 13% faster at 256 sequences of 350 tokens (x86 only: other targets lack the flag).
COMPILE_FLAGS = ["-O3", "-march=native", *(["-mprefer-vector-width=512"] if platform.machine() in ("x86_64", "AMD64") else []),
                 "-ffast-math", "-fopenmp", "-fPIC"]
LINK_FLAGS = ["-shared", "-fopenmp"]
SUPPORTED_DTYPES = {torch.float32: 0, torch.bfloat16: 1}


def cache_dir() -> Path:
    default = Path.home() / ".cache" / "tessera" / "kernels"
    return Path(os.environ.get("TESSERA_KERNEL_CACHE") or default)


def _cpu_id() -> str:
    """-march=native code is only valid on the CPU that built it: the cache key names the CPU."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = [ln for ln in f if ln.startswith(("model name", "flags"))][:2]
    except OSError:
        lines = []
    return platform.machine() + "".join(lines)


def _compile(compiler: str) -> Path:
    source = SOURCE.read_bytes()
    key = hashlib.sha256(source + " ".join([compiler, *COMPILE_FLAGS, *LINK_FLAGS, _cpu_id()]).encode()).hexdigest()[:16]
    target = cache_dir() / f"decode_attention-{key}.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        # Build beside the target, then rename: processes that build at once never see half a file.
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
        os.close(fd)
        obj = tmp + ".o"
        try:
            subprocess.run([compiler, *COMPILE_FLAGS, "-c", str(SOURCE), "-o", obj], check=True, capture_output=True)
            subprocess.run([compiler, *LINK_FLAGS, obj, "-o", tmp, "-lm"], check=True, capture_output=True)
            os.replace(tmp, target)
        finally:
            for leftover in (tmp, obj):
                if os.path.exists(leftover):
                    os.unlink(leftover)
    return target


@functools.cache
def load():
    """The compiled library, or None when native kernels are off or cannot be built here."""
    if os.environ.get("TESSERA_NATIVE_KERNELS", "1") == "0":
        return None
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        return None
    try:
        lib = ctypes.CDLL(str(_compile(compiler)))
    except (OSError, subprocess.CalledProcessError):
        return None
    fn = lib.paged_decode_attention
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p] + [ctypes.c_int] * 6 \
        + [ctypes.c_float, ctypes.c_int]
    return lib


def supports(q, k_cache) -> bool:
    return q.device.type == "cpu" and q.dtype == k_cache.dtype and q.dtype in SUPPORTED_DTYPES


def paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale):
    """Same meaning and signature as torch_ref.paged_decode_attention; needs load() to succeed."""
    q = q.contiguous()
    block_tables = block_tables.to(torch.int32).contiguous()
    seq_lens = seq_lens.to(torch.int32).contiguous()
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("the paged caches must be contiguous")
    batch, num_heads, head_dim = q.shape
    out = torch.empty_like(q)
    if batch == 0:
        return out
    status = load().paged_decode_attention(
        q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), block_tables.data_ptr(), block_tables.shape[1],
        seq_lens.data_ptr(), out.data_ptr(), batch, num_heads, k_cache.shape[2], head_dim,
        k_cache.shape[1], SUPPORTED_DTYPES[q.dtype], scale, torch.get_num_threads())
    if status:
        raise MemoryError("native decode attention could not allocate its scratch memory")
    return out
