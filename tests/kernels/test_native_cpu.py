"""kernels/tessera_kernels/native_cpu.py (the C kernels) against their kernels/tessera_kernels/torch_ref.py twins.

Caches come from make_paged_kv: shuffled block ids and NaN in every slot no sequence owns, so a
read past a sequence's used length fails. This machine has a C compiler, so a library that does
not build is a failure here, not a skip. Every check runs twice: on the library as the engine
builds it (the AVX-512 decode path on the x86 machines we run on) and on a build with AVX-512
switched off, which runs the portable decode loop that other CPUs get.
"""

import os
import platform
import shutil
import subprocess
import sys

import pytest
import torch
from _kernel_testlib import assert_close, make_paged_kv, randn

from inference.layers.ops import get_ops
from tessera_kernels import native_cpu, torch_ref


def compiler() -> str:
    found = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    assert found, "no C compiler: the native CPU kernels cannot build"
    return found


@pytest.fixture(scope="module", params=["engine build", "portable build"])
def lib(request):
    if request.param == "engine build":
        built = native_cpu.load()
        assert built is not None, "kernels/tessera_kernels/csrc failed to build"
        return built
    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("-mno-avx512f is an x86 flag; elsewhere the engine build is already the portable one")
    return native_cpu.open_library(native_cpu._compile(compiler(), extra_flags=("-mno-avx512f",)))


def with_threads(threads, fn, *args):
    previous = torch.get_num_threads()
    torch.set_num_threads(threads or previous)
    try:
        return fn(*args)
    finally:
        torch.set_num_threads(previous)


def _check(lib, lens, num_kv_heads, group, head_dim, block_size, dtype, seed=0, threads=None):
    paged = make_paged_kv(lens, num_kv_heads, head_dim, block_size, dtype, seed=seed, device="cpu")
    q = randn(len(lens), num_kv_heads * group, head_dim, dtype=dtype, seed=seed + 100, device="cpu")
    args = (q, paged.k_cache, paged.v_cache, paged.block_tables, paged.seq_lens, head_dim**-0.5)
    expected = torch_ref.paged_decode_attention(*args)
    out = with_threads(threads, native_cpu.paged_decode_attention, *args, lib)
    assert out.dtype == q.dtype
    assert_close(out, expected, "attention", dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_queries_as_rows_of_the_fused_qkv_output(lib, dtype):
    # the model hands attention q as a view: each token's heads contiguous, tokens a QKV row apart
    lens, kv_heads, heads, dim = [5, 40, 17], 2, 6, 64
    paged = make_paged_kv(lens, kv_heads, dim, 16, dtype, seed=3, device="cpu")
    qkv = randn(len(lens), (heads + 2 * kv_heads) * dim, dtype=dtype, seed=4, device="cpu")
    q = qkv[:, : heads * dim].reshape(len(lens), heads, dim)
    args = (paged.k_cache, paged.v_cache, paged.block_tables, paged.seq_lens, dim**-0.5)
    out = native_cpu.paged_decode_attention(q, *args, lib)
    assert not q.is_contiguous()
    assert_close(out, torch_ref.paged_decode_attention(q.contiguous(), *args), "attention", dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("group", [1, 4, 8])
def test_matches_reference(lib, dtype, block_size, group):
    # 1 token, exactly one full block, one past the boundary, and a partial third block.
    _check(lib, [1, block_size, block_size + 1, 2 * block_size + 7], 2, group, 64, block_size, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [128, 80, 48])
def test_head_sizes(lib, head_dim, dtype):
    # 128 and 64 have unrolled instances; 80 (not a multiple of 32: no vdpbf16ps) and 48 run the
    # head size as a variable; block size 8 puts two blocks in one 16-row chunk.
    _check(lib, [5, 33], 1, 4, head_dim, 16, dtype, seed=7)
    _check(lib, [3, 17, 40], 2, 3, head_dim, 8, dtype, seed=8)


@pytest.mark.parametrize("head_dim,group", [(64, 1), (64, 2), (64, 3), (64, 4), (64, 5), (128, 1), (128, 2), (128, 3)])
def test_every_bfloat16_query_group_layout(lib, head_dim, group):
    # The grouped V loop has an instance per group that fits in registers (64: up to 4 heads a
    # KV head, 128: up to 2); the next group size up takes the general loop.
    _check(lib, [1, 16, 17, 300], 2, group, head_dim, 16, torch.bfloat16, seed=11)


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_many_sequences_any_thread_count(lib, threads):
    # More sequences than threads, very uneven lengths (dynamic sharing of the work), some long
    # enough that the prefetches run a whole window ahead of the compute.
    lens = torch.randint(1, 1500, (37,), generator=torch.Generator().manual_seed(4)).tolist()
    _check(lib, lens, 2, 4, 64, 16, torch.float32, seed=9, threads=threads)
    _check(lib, lens, 2, 4, 64, 16, torch.bfloat16, seed=9, threads=threads)


def test_empty_batch(lib):
    paged = make_paged_kv([3], 2, 64, 16, torch.float32, device="cpu")
    q = torch.empty(0, 8, 64)
    out = native_cpu.paged_decode_attention(
        q, paged.k_cache, paged.v_cache, paged.block_tables[:0], paged.seq_lens[:0], 0.125
    )
    assert out.shape == (0, 8, 64)


def _check_prefill(lib, cases, num_kv_heads, group, head_dim, block_size, dtype, seed=0, threads=None):
    """cases: (cached prefix length, new tokens) per sequence. q is a view into a fused QKV output."""
    lens = [ctx + n for ctx, n in cases]
    paged = make_paged_kv(lens, num_kv_heads, head_dim, block_size, dtype, seed=seed, device="cpu")
    q_lens = [n for _, n in cases]
    qsl = torch.tensor([0] + q_lens).cumsum(0).to(torch.int32)
    heads = num_kv_heads * group
    qkv = randn(sum(q_lens), (heads + 2 * num_kv_heads) * head_dim, dtype=dtype, seed=seed + 100, device="cpu")
    q = qkv[:, : heads * head_dim].view(-1, heads, head_dim)
    assert native_cpu.supports_prefill(q, paged.k_cache)
    args = (q, paged.k_cache, paged.v_cache, paged.block_tables, qsl, paged.seq_lens, head_dim**-0.5)
    expected = torch_ref.paged_prefill_attention(*args)
    out = with_threads(threads, native_cpu.paged_prefill_attention, *args, lib)
    assert out.dtype == q.dtype
    assert_close(out, expected, "attention", dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("group", [1, 3, 4, 8])
def test_prefill_matches_reference(lib, dtype, block_size, group):
    cases = [
        (0, 1),  # a 1-token prompt
        (0, block_size),  # a prompt ending exactly on a block boundary
        (block_size, 1),  # one token past a cached full block
        (block_size - 3, 20),  # an extend over a cached prefix (chunked prefill, a prefix-cache hit)
        (2 * block_size, 0),  # no new tokens this step
        (0, 70),  # a fresh prompt over 3 tiles of 32 tokens and 2 chunks of 64 keys
        (100, 45),  # an extend whose tiles start mid-chunk
    ]
    _check_prefill(lib, cases, 2, group, 64, block_size, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [128, 80, 48])
def test_prefill_head_sizes(lib, head_dim, dtype):
    # 64 and 128 have unrolled instances; 80 and 48 run the head size as a variable (80: one pass of
    # four vectors and one of one).
    _check_prefill(lib, [(0, 33), (17, 9)], 1, 4, head_dim, 16, dtype, seed=7)
    _check_prefill(lib, [(5, 70), (0, 3)], 3, 3, head_dim, 8, dtype, seed=8)


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_prefill_long_uneven_batch_any_thread_count(lib, threads):
    # A step's worth of work: long prompts and extends of very different sizes, shared out dynamically.
    gen = torch.Generator().manual_seed(5)
    cases = [
        (int(torch.randint(0, 600, (1,), generator=gen)), int(torch.randint(1, 400, (1,), generator=gen)))
        for _ in range(9)
    ]
    _check_prefill(lib, cases, 2, 4, 64, 16, torch.float32, seed=9, threads=threads)
    _check_prefill(lib, cases, 3, 3, 64, 16, torch.bfloat16, seed=9, threads=threads)


def test_prefill_routing_in_the_torch_backend(lib):
    ops = get_ops("torch")
    assert ops.p.paged_prefill_attention is not torch_ref.paged_prefill_attention
    cache = torch.zeros(4, 16, 2, 64)
    assert native_cpu.supports_prefill(torch.zeros(5, 8, 64), cache)
    assert not native_cpu.supports_prefill(torch.zeros(5, 8, 64, dtype=torch.float16), cache.half())
    assert not native_cpu.supports_prefill(torch.zeros(5, 8, 72), torch.zeros(4, 16, 2, 72))  # not whole vectors
    assert not native_cpu.supports_prefill(torch.zeros(5, 32, 64), cache)  # 16 query heads a KV head
    assert not native_cpu.supports_prefill(torch.zeros(8, 5, 64).transpose(0, 1), cache)  # heads not contiguous
    # What it does not take, the reference answers.
    paged = make_paged_kv([20, 7], 1, 72, 16, torch.float32, device="cpu")
    q = randn(27, 4, 72, dtype=torch.float32, seed=2, device="cpu")
    args = (
        q,
        paged.k_cache,
        paged.v_cache,
        paged.block_tables,
        torch.tensor([0, 20, 27], dtype=torch.int32),
        paged.seq_lens,
        72**-0.5,
    )
    torch.testing.assert_close(ops.p.paged_prefill_attention(*args), torch_ref.paged_prefill_attention(*args))


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
        built = list(tmp_path.glob("native-*.so"))
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
    script = (
        "from tessera_kernels import native_cpu\n"
        "assert native_cpu.load() is not None\n"
        "print(2.2250738585072014e-308 / 2 != 0.0)\n"
    )
    env = {**os.environ, "TESSERA_KERNEL_CACHE": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "True"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 7, 300])
@pytest.mark.parametrize("threads", [1, 2])
def test_fused_add_rms_norm(lib, dtype, rows, threads):
    x, residual = (
        randn(rows, 576, dtype=dtype, seed=1, device="cpu"),
        randn(rows, 576, dtype=dtype, seed=2, device="cpu"),
    )
    weight = (1 + 0.1 * randn(576, dtype=torch.float32, seed=3, device="cpu")).to(dtype)
    normed, summed = with_threads(threads, native_cpu.fused_add_rms_norm, x, residual, weight, 1e-6, lib)
    expected_normed, expected_summed = torch_ref.fused_add_rms_norm(x, residual, weight, 1e-6)
    assert torch.equal(summed, expected_summed)  # one rounded add, as torch does it
    assert_close(normed, expected_normed, "elementwise", dtype)
    # The first layer has no residual yet: the sum is x itself, returned without a copy.
    normed, summed = with_threads(threads, native_cpu.fused_add_rms_norm, x, None, weight, 1e-6, lib)
    assert summed is x
    assert_close(normed, torch_ref.fused_add_rms_norm(x, None, weight, 1e-6)[0], "elementwise", dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_and_mul_at_the_ends_of_exp(lib, dtype):
    """vec.h's exp_vec: 0 below -87 (masked lanes of the AVX-512 form), e^88 above 88, 1 near 0."""
    gate = torch.tensor([-1e4, -200, -104, -88, -87, -86, -20, -1e-30, 0, 1e-30, 20, 86, 88, 89, 200, 1e4] * 2)
    up = torch.linspace(-3, 3, gate.numel())
    x = torch.cat([gate, up]).view(1, -1).to(dtype)
    out = native_cpu.silu_and_mul(x, lib)
    assert out.isfinite().all()
    assert_close(out, torch_ref.silu_and_mul(x), "elementwise", dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 300])
def test_silu_and_mul(lib, dtype, rows):
    x = 3 * randn(rows, 2 * 1536, dtype=dtype, seed=4, device="cpu")
    out = native_cpu.silu_and_mul(x, lib)
    assert out.shape == (rows, 1536) and out.dtype == dtype
    assert_close(out, torch_ref.silu_and_mul(x), "elementwise", dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_on_views_of_the_fused_qkv_output(lib, dtype):
    from inference.layers.rotary import cos_sin_cache

    tokens, heads, kv_heads, dim = 37, 9, 3, 64
    qkv = randn(tokens, (heads + 2 * kv_heads) * dim, dtype=dtype, seed=5, device="cpu")
    q, k, v = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    q, k = q.reshape(tokens, heads, dim), k.reshape(tokens, kv_heads, dim)  # strided views, as in the model
    untouched_v = v.clone()
    positions = torch.randint(0, 2048, (tokens,), generator=torch.Generator().manual_seed(6))
    cache = cos_sin_cache(dim, 2048, 10000.0, None, torch.float32)
    q_ref, k_ref = q.clone(), k.clone()
    torch_ref.rotary_embedding(positions, q_ref, k_ref, cache)
    assert native_cpu.supports_rotary(q, k, cache)
    native_cpu.rotary_embedding(positions, q, k, cache, lib)
    assert_close(q, q_ref, "elementwise", dtype)
    assert_close(k, k_ref, "elementwise", dtype)
    assert torch.equal(v, untouched_v)  # rows are strided: nothing outside q and k is written


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dim", [64, 128, 40])
def test_each_row_comes_out_as_it_does_alone(lib, dtype, dim):
    """Speculative verification scores 1 + k rows in one step and must give each the bits a one-row
    decode step gives it: every per-row kernel is invariant to the rows beside it."""
    from inference.layers.rotary import cos_sin_cache

    rows, heads, kv_heads, hidden = 6, 9, 3, 576
    qkv = randn(rows, (heads + 2 * kv_heads) * dim, dtype=dtype, seed=7, device="cpu")
    positions = torch.arange(40, 40 + rows)
    cache = cos_sin_cache(dim, 2048, 10000.0, None, torch.float32)

    def rotated(x, at):
        x = x.clone()
        q = x[:, : heads * dim].reshape(len(x), heads, dim)
        k = x[:, heads * dim : (heads + kv_heads) * dim].reshape(len(x), kv_heads, dim)
        native_cpu.rotary_embedding(at, q, k, cache, lib)
        return x

    x = randn(rows, hidden, dtype=dtype, seed=8, device="cpu")
    residual = randn(rows, hidden, dtype=dtype, seed=9, device="cpu")
    weight = (1 + 0.1 * randn(hidden, dtype=torch.float32, seed=3, device="cpu")).to(dtype)
    gate_up = randn(rows, 2 * hidden, dtype=dtype, seed=10, device="cpu")
    together = rotated(qkv, positions)
    normed, _ = native_cpu.fused_add_rms_norm(x, residual, weight, 1e-6, lib)
    activated = native_cpu.silu_and_mul(gate_up, lib)
    for row in range(rows):
        one = slice(row, row + 1)
        assert torch.equal(together[row], rotated(qkv[one], positions[one])[0])
        assert torch.equal(normed[row], native_cpu.fused_add_rms_norm(x[one], residual[one], weight, 1e-6, lib)[0][0])
        assert torch.equal(activated[row], native_cpu.silu_and_mul(gate_up[one], lib)[0])


def _qkv_views(tokens, heads, kv_heads, dim, dtype, seed):
    qkv = randn(tokens, (heads + 2 * kv_heads) * dim, dtype=dtype, seed=seed, device="cpu")
    _q, k, v = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    return k.reshape(tokens, kv_heads, dim), v.reshape(tokens, kv_heads, dim)  # strided, as in the model


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_store_kv_writes_views_of_the_qkv_output_into_their_slots_only(lib, dtype):
    blocks, block_size, kv_heads, dim, tokens = 12, 16, 3, 64, 50
    k, v = _qkv_views(tokens, 9, kv_heads, dim, dtype, seed=7)
    slots = torch.randperm(blocks * block_size, generator=torch.Generator().manual_seed(8))[:tokens]
    slots[[3, 17, 40]] = -1  # padding rows: skipped
    caches = [torch.full((blocks, block_size, kv_heads, dim), float("nan"), dtype=dtype) for _ in range(4)]
    torch_ref.store_kv_cache(k, v, caches[0], caches[1], slots)
    assert native_cpu.supports_store(k, v, caches[2], caches[3])
    native_cpu.store_kv_cache(k, v, caches[2], caches[3], slots, lib)
    for ours, reference in ((caches[2], caches[0]), (caches[3], caches[1])):
        assert torch.equal(ours.isnan(), reference.isnan())  # the same slots written, every other left alone
        assert torch.equal(ours.nan_to_num(), reference.nan_to_num())


def test_store_kv_refuses_a_slot_past_the_cache_and_writes_nothing(lib):
    k, v = _qkv_views(4, 8, 2, 64, torch.float32, seed=9)
    k_cache, v_cache = torch.zeros(2, 16, 2, 64), torch.zeros(2, 16, 2, 64)
    with pytest.raises(IndexError, match="slot 32 of token 2"):
        native_cpu.store_kv_cache(k, v, k_cache, v_cache, torch.tensor([0, 1, 32, 3]), lib)
    assert not k_cache.any() and not v_cache.any()


def test_store_kv_falls_back_for_other_layouts_and_dtypes():
    k, v = _qkv_views(4, 8, 2, 64, torch.float32, seed=10)
    cache = torch.zeros(2, 16, 2, 64)
    assert not native_cpu.supports_store(k, v, cache.bfloat16(), cache.bfloat16())  # the reference casts
    assert not native_cpu.supports_store(k.transpose(0, 1), v, cache, cache)
    assert not native_cpu.supports_store(k, v, cache.transpose(1, 2), cache)
    assert not native_cpu.supports_store(k, v, torch.zeros(2, 16, 4, 32), torch.zeros(2, 16, 4, 32))  # not its rows


def test_torch_backend_routes_the_elementwise_kernels(lib):
    ops = get_ops("torch")
    for name in ("fused_add_rms_norm", "silu_and_mul", "rotary_embedding", "store_kv_cache"):
        assert getattr(ops.p, name) is not getattr(torch_ref, name)
    # float16 is not compiled in: the reference answers.
    x = randn(4, 64, dtype=torch.float16, seed=1, device="cpu")
    weight = torch.ones(64, dtype=torch.float16)
    torch.testing.assert_close(
        ops.p.fused_add_rms_norm(x, x, weight, 1e-6)[0], torch_ref.fused_add_rms_norm(x, x, weight, 1e-6)[0]
    )
    torch.testing.assert_close(ops.p.silu_and_mul(x), torch_ref.silu_and_mul(x))
    assert not native_cpu.supports_rows(x) and not native_cpu.supports_rows(x.float(), x)
