"""kernels/native_cpu.py (the C decode attention) against torch_ref.paged_decode_attention.

Caches come from make_paged_kv: shuffled block ids and NaN in every slot no sequence owns, so a
read past a sequence's used length fails. This machine has a C compiler, so a library that does
not build is a failure here, not a skip.
"""
import os
import shutil
import subprocess
import sys

import pytest
import torch

from _kernel_testlib import assert_close, make_paged_kv, randn
from inference.layers.ops import get_ops
from kernels import native_cpu, torch_ref


@pytest.fixture(scope="module")
def lib():
    assert shutil.which("cc") or shutil.which("gcc"), "no C compiler: the native CPU kernels cannot build"
    built = native_cpu.load()
    assert built is not None, "kernels/csrc/decode_attention.c failed to build"
    return built


def _check(lens, num_kv_heads, group, head_dim, block_size, dtype, seed=0, threads=None):
    paged = make_paged_kv(lens, num_kv_heads, head_dim, block_size, dtype, seed=seed, device="cpu")
    q = randn(len(lens), num_kv_heads * group, head_dim, dtype=dtype, seed=seed + 100, device="cpu")
    args = (q, paged.k_cache, paged.v_cache, paged.block_tables, paged.seq_lens, head_dim ** -0.5)
    expected = torch_ref.paged_decode_attention(*args)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads or previous)
    try:
        out = native_cpu.paged_decode_attention(*args)
    finally:
        torch.set_num_threads(previous)
    assert out.dtype == q.dtype
    assert_close(out, expected, "attention", dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("group", [1, 4, 8])
def test_matches_reference(lib, dtype, block_size, group):
    # 1 token, exactly one full block, one past the boundary, and a partial third block.
    _check([1, block_size, block_size + 1, 2 * block_size + 7], 2, group, 64, block_size, dtype)


@pytest.mark.parametrize("head_dim", [128, 80])
def test_head_sizes(lib, head_dim):
    _check([5, 33], 1, 4, head_dim, 16, torch.float32, seed=7)


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_many_sequences_any_thread_count(lib, threads):
    # More sequences than threads, very uneven lengths (dynamic sharing of the work).
    lens = torch.randint(1, 300, (37,), generator=torch.Generator().manual_seed(4)).tolist()
    _check(lens, 2, 4, 64, 16, torch.float32, seed=9, threads=threads)


def test_empty_batch(lib):
    paged = make_paged_kv([3], 2, 64, 16, torch.float32, device="cpu")
    q = torch.empty(0, 8, 64)
    out = native_cpu.paged_decode_attention(q, paged.k_cache, paged.v_cache, paged.block_tables[:0],
                                            paged.seq_lens[:0], 0.125)
    assert out.shape == (0, 8, 64)


def test_torch_backend_uses_it_on_cpu_and_falls_back_elsewhere(lib):
    ops = get_ops("torch")
    assert ops.p.paged_decode_attention is not torch_ref.paged_decode_attention
    assert native_cpu.supports(torch.zeros(1, dtype=torch.float32), torch.zeros(1, dtype=torch.float32))
    assert not native_cpu.supports(torch.zeros(1, dtype=torch.float16), torch.zeros(1, dtype=torch.float16))
    # float16 is not compiled in: the torch backend answers through the reference instead.
    paged = make_paged_kv([20, 7], 2, 64, 16, torch.float16, device="cpu")
    q = randn(2, 8, 64, dtype=torch.float16, seed=1, device="cpu")
    args = (q, paged.k_cache, paged.v_cache, paged.block_tables, paged.seq_lens, 0.125)
    torch.testing.assert_close(ops.p.paged_decode_attention(*args), torch_ref.paged_decode_attention(*args))


def test_switched_off_by_env(monkeypatch, tmp_path):
    monkeypatch.setenv("TESSERA_NATIVE_KERNELS", "0")
    native_cpu.load.cache_clear()
    try:
        assert native_cpu.load() is None
        assert get_ops("torch").p is torch_ref
    finally:
        monkeypatch.undo()
        native_cpu.load.cache_clear()


def test_build_is_cached_per_source_and_cpu(lib, monkeypatch, tmp_path):
    monkeypatch.setenv("TESSERA_KERNEL_CACHE", str(tmp_path))
    native_cpu.load.cache_clear()
    try:
        assert native_cpu.load() is not None
        built = list(tmp_path.glob("decode_attention-*.so"))
        assert len(built) == 1
        mtime = built[0].stat().st_mtime_ns
        native_cpu.load.cache_clear()
        native_cpu.load()
        assert built[0].stat().st_mtime_ns == mtime  # reused, not rebuilt
        assert list(tmp_path.glob("*.so")) == built  # no temporary files left behind
    finally:
        monkeypatch.undo()
        native_cpu.load.cache_clear()


def test_loading_the_library_leaves_the_process_float_environment_alone(tmp_path):
    """A subnormal must survive in a process that loaded the kernel (fast-math's flush-to-zero would
    flush it, for torch and every other library in the process)."""
    script = ("from kernels import native_cpu\n"
              "assert native_cpu.load() is not None\n"
              "print(2.2250738585072014e-308 / 2 != 0.0)\n")
    env = {**os.environ, "TESSERA_KERNEL_CACHE": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "True"
