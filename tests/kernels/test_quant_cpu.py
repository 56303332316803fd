"""kernels/tessera_kernels/quant_cpu.py (csrc/quant_gemm.c) against the gguf package's dequantization.

Every kernel type, on four builds of the library: as the engine builds it (AVX-512 VNNI and GFNI on the
machines we run on), without GFNI (the fused kernels' plain shifts and masks), without AVX-512 (the AVX2
loop) and without AVX2 (the plain C loop); and each in
the file's block order and in the layout the engine loads (quant_cpu.kernel_layout: where the build has
their fused kernels, the rows interleaved 16 to a group; the file's order runs the decoded path).

Tolerance: the kernel quantizes each activation block (quant_cpu.activation_block: 32 values, 256 for
the K-quants on the AVX-512 VNNI kernel) to int8 (step max|x| / 127), so an output may differ from
the dequantize-then-matmul reference by up to sum_i |w_i| * max|x| of i's block / 254 (half a step
per product); each output is checked
against its own bound, plus 1e-5 of the output's scale for float32 rounding. Dequantized rows
must equal the gguf package's values exactly. From quant_cpu.leaves_integer_at rows on, `linear`
runs a bfloat16 GEMM instead (AMX's tiles, or oneDNN's on the dequantized weight; quant_cpu.path): weight
and activations rounded to bfloat16
(2^-8 each, so 2^-7 of sum_i |w_i x_i|), the product rounded once more (2^-8 of the output), plus
float32 accumulation (in_features * 2^-24 of sum_i |w_i x_i|).
"""

import platform

import numpy as np
import pytest
import torch
from packed_bounds import activation_bound
from test_native_cpu import compiler

from tessera_kernels import native_cpu, quant_cpu

# The gguf package quantizes these five; K-quant blocks are random bytes with sane f16 scales at
# these byte offsets (random bytes there would give scales up to 65504 or NaN).
K_SCALE_OFFSETS = {"Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}
BUILDS = {
    "engine build": (),
    "AVX-512 without GFNI": ("-mno-gfni",),
    "AVX2 build": ("-mno-avx512f",),
    "portable build": ("-mno-avx512f", "-mno-avx2", "-mno-fma", "-mno-f16c"),
}


@pytest.fixture(params=["file order", "kernel layout"])
def layout(request) -> str:
    return request.param


def laid_out(layout: str, kind: str, packed: torch.Tensor, cols: int, lib) -> tuple[torch.Tensor, str]:
    """(blocks, kind) as the kernels get them (the order `linear` takes): the file's order, or the layout
    the engine loads."""
    held_kind, held = quant_cpu.kernel_layout(kind, packed, cols, lib) if layout == "kernel layout" else (kind, packed)
    return held, held_kind


@pytest.fixture(scope="module", params=list(BUILDS))
def lib(request):
    if request.param == "engine build":
        built = native_cpu.load()
        assert built is not None, "kernels/tessera_kernels/csrc failed to build"
        return built
    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("the -mno-* flags are x86 flags; elsewhere the engine build is already the portable one")
    return native_cpu.open_library(native_cpu._compile(compiler(), extra_flags=BUILDS[request.param]))


def gguf_blocks(kind: str, rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    """[rows, row_bytes] uint8 blocks of type `kind` holding rows x cols values."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, quants

    rng = np.random.default_rng(seed)
    if kind not in K_SCALE_OFFSETS:
        values = rng.standard_normal((rows, cols)).astype(np.float32)
        return torch.from_numpy(quants.quantize(values, GGMLQuantizationType[kind]))
    block_values, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType[kind]]
    blocks = rng.integers(0, 256, (rows, cols // block_values, block_bytes), dtype=np.uint8)
    for offset in K_SCALE_OFFSETS[kind]:
        scales = rng.uniform(1e-3, 1e-2, blocks.shape[:2]).astype(np.float16)
        blocks[..., offset : offset + 2] = scales.view(np.uint8).reshape(*blocks.shape[:2], 2)
    return torch.from_numpy(blocks.reshape(rows, -1))


def dequantized(packed: torch.Tensor, kind: str) -> torch.Tensor:
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    return torch.from_numpy(np.ascontiguousarray(dequantize(packed.numpy(), GGMLQuantizationType[kind])))


def assert_within_bound(out, reference, packed, kind, x, lib):
    block = quant_cpu.activation_block(kind, x.shape[1], lib)
    bound = activation_bound(dequantized(packed, kind), x, block) + 1e-5 * reference.abs().max() + 1e-6
    excess = ((out.float() - reference).abs() - bound).max()
    assert excess <= 0, f"an output is {float(excess):.3g} past its bound"


@pytest.mark.parametrize("kind", quant_cpu.KERNEL_TYPES)
@pytest.mark.parametrize("rows_in", [1, 7])
def test_linear_matches_dequantize_then_matmul(lib, layout, kind, rows_in):
    cols = 512
    packed = gguf_blocks(kind, 37, cols, seed=rows_in)  # 37: a partial last tile of 4 weight rows
    x = torch.randn(rows_in, cols, generator=torch.Generator().manual_seed(1))
    bias = torch.randn(37, generator=torch.Generator().manual_seed(2))
    out = quant_cpu.linear(x, *laid_out(layout, kind, packed, cols, lib), cols, bias, library=lib)
    assert out.shape == (rows_in, 37) and out.dtype == torch.float32
    assert_within_bound(out, quant_cpu.reference_linear(x, packed, kind, bias), packed, kind, x, lib)


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"])
@pytest.mark.parametrize("rows", [1, 5, 16, 21, 47])
def test_rows_that_end_in_a_partial_group_of_sixteen_rows(lib, layout, kind, rows):
    # the kernel layout interleaves rows 16 to a group; a last group of fewer rows holds each of their
    # fields that many rows wide. The file's order must come back byte for byte, each row dequantize as
    # the file's, and each row's output not depend on the activation rows beside it.
    cols = 768
    packed = gguf_blocks(kind, rows, cols, seed=rows)
    held, held_kind = laid_out(layout, kind, packed, cols, lib)
    assert torch.equal(quant_cpu.file_layout(held_kind, held, cols, lib)[1], packed)
    ids = torch.arange(rows).flip(0)
    rows_back = quant_cpu.dequantize_rows(held, held_kind, ids, cols, library=lib)
    assert torch.equal(rows_back, dequantized(packed, kind)[ids])
    x = torch.randn(9, cols, generator=torch.Generator().manual_seed(rows))
    out = quant_cpu.integer_linear(x, held, held_kind, cols, library=lib)
    assert_within_bound(out, quant_cpu.reference_linear(x, packed, kind), packed, kind, x, lib)
    for row in range(9):
        assert torch.equal(out[row], quant_cpu.integer_linear(x[row : row + 1], held, held_kind, cols, library=lib)[0])


@pytest.mark.parametrize("kind", ["Q4_0", "Q5_1", "Q8_0"])
@pytest.mark.parametrize("rows_in", [3, 6])
def test_rows_past_the_vector_loop_and_into_an_output_slice(lib, layout, kind, rows_in):
    # 96 values: one 64-wide VNNI step and 32 left for the tail loop (6 rows: one block of 4 rows and
    # 2 alone); the result lands in columns 3..19 of a wider output (a merged layer's segment),
    # leaving the others untouched.
    cols = 96
    packed = gguf_blocks(kind, 16, cols, seed=5)
    x = torch.randn(rows_in, cols, generator=torch.Generator().manual_seed(6))
    wide = torch.full((rows_in, 24), 7.0)
    quant_cpu.linear(x, *laid_out(layout, kind, packed, cols, lib), cols, out=wide[:, 3:19], library=lib)
    assert_within_bound(wide[:, 3:19], quant_cpu.reference_linear(x, packed, kind), packed, kind, x, lib)
    assert torch.equal(wide[:, :3], torch.full((rows_in, 3), 7.0))
    assert torch.equal(wide[:, 19:], torch.full((rows_in, 5), 7.0))


@pytest.mark.parametrize("kind", quant_cpu.KERNEL_TYPES)
def test_the_integer_kernel_on_many_rows_in_blocks(lib, layout, kind):
    # below the crossover only, in the engine; called directly here so the kernels' blocks of rows (8 on
    # the fused path, 4 on the decoded one) and a rest meet a partial last tile of weight rows at a size
    # `linear` would send to bfloat16
    cols = 512
    packed = gguf_blocks(kind, 37, cols, seed=11)
    x = torch.randn(quant_cpu.DEQUANTIZE_FROM_ROWS + 3, cols, generator=torch.Generator().manual_seed(12))
    out = quant_cpu.integer_linear(x, *laid_out(layout, kind, packed, cols, lib), cols, library=lib)
    assert_within_bound(out, quant_cpu.reference_linear(x, packed, kind), packed, kind, x, lib)


@pytest.mark.parametrize("kind", quant_cpu.KERNEL_TYPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_each_activation_row_comes_out_as_it_does_alone(lib, layout, kind, dtype):
    # speculative verification scores 1 + k rows in one call and must give each the bits a one-row
    # decode gives it: below the crossover a row's output may not depend on the rows beside it
    cols, rows_in = 512, 11  # a block of 8 rows and a rest of 3 (fused path), 4 + 4 + 3 (decoded path)
    packed, kind = laid_out(layout, kind, gguf_blocks(kind, 37, cols, seed=21), cols, lib)
    x = torch.randn(rows_in, cols, generator=torch.Generator().manual_seed(22)).to(dtype)
    together = quant_cpu.integer_linear(x, packed, kind, cols, library=lib)
    for row in range(rows_in):
        alone = quant_cpu.integer_linear(x[row : row + 1], packed, kind, cols, library=lib)
        assert torch.equal(together[row], alone[0])


@pytest.mark.parametrize("kind", quant_cpu.KERNEL_TYPES)
def test_linear_keeps_the_integer_kernel_up_to_its_crossover(lib, kind):
    # interleaved rows leave the integer kernel for AMX's tiles where the library has them, else never; the
    # decoded path's rows for the bfloat16 path (docs/kernels.md); below the crossover every row comes out
    # as it does alone, and as it does on the integer kernel
    cols = 512
    packed, kind = laid_out("kernel layout", kind, gguf_blocks(kind, 37, cols, seed=23), cols, lib)
    crossover = quant_cpu.leaves_integer_at(kind, cols, lib)
    if quant_cpu.tiles(kind, cols, lib):
        expected = quant_cpu.TILES_FROM_ROWS
    elif kind.endswith(quant_cpu.X16):
        expected = None
    else:
        expected = quant_cpu.DEQUANTIZE_FROM_ROWS
    assert crossover == expected
    rows_in = (crossover or 4 * quant_cpu.DEQUANTIZE_FROM_ROWS) - 1
    x = torch.randn(rows_in, cols, generator=torch.Generator().manual_seed(24))
    together = quant_cpu.linear(x, packed, kind, cols, library=lib)
    assert torch.equal(together, quant_cpu.integer_linear(x, packed, kind, cols, library=lib))


@pytest.mark.parametrize("kind", ["Q4_1", "Q4_K", "Q3_K"])  # interleaved 32-value, interleaved K-quant, decoded
def test_a_steps_decode_rows_go_apart_from_its_prefill_rows(lib, kind, monkeypatch):
    # past the crossover, the first decode_rows rows come out as a call of their own gives them (the
    # integer kernel here), the rest as theirs would: a decode row's bits never depend on a chunk beside it
    monkeypatch.setattr(quant_cpu, "DEQUANTIZE_FROM_ROWS", 12)
    monkeypatch.setattr(quant_cpu, "TILES_FROM_ROWS", 12)
    cols = 512
    packed, kind = laid_out("kernel layout", kind, gguf_blocks(kind, 37, cols, seed=25), cols, lib)
    if quant_cpu.path(kind, cols, 40, lib) == "integer":
        pytest.skip("interleaved rows keep the integer kernel at every count where the library has no AMX tiles")
    kernels = {"tiles": quant_cpu.tile_linear, "dequantized": quant_cpu.dequantized_linear}
    past = kernels[quant_cpu.path(kind, cols, 35, lib)]
    x = torch.randn(40, cols, generator=torch.Generator().manual_seed(26))
    split = quant_cpu.linear(x, packed, kind, cols, library=lib, decode_rows=5)
    assert torch.equal(split[:5], quant_cpu.integer_linear(x[:5], packed, kind, cols, library=lib))
    assert torch.equal(split[5:], past(x[5:], packed, kind, cols, library=lib))
    together = quant_cpu.linear(x, packed, kind, cols, library=lib)
    assert torch.equal(together, past(x, packed, kind, cols, library=lib))
    assert not torch.equal(together[:5], split[:5])  # what going apart changes


def bfloat16_bound(weight: torch.Tensor, x: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
    """[m, rows]: the most the bfloat16 path can move each output (see the module docstring)."""
    magnitude = x.float().abs() @ weight.abs().float().T
    return magnitude * (2**-7 + x.shape[1] * 2**-24) + reference.abs() * 2**-8 + 1e-6


def assert_within_bfloat16_bound(out, packed, kind, x, bias=None):
    reference = quant_cpu.reference_linear(x, packed, kind, bias)
    bound = bfloat16_bound(dequantized(packed, kind), x, reference)
    if out.dtype == torch.bfloat16:  # the bias is added after the product, then rounded with it
        bound = bound + reference.abs() * 2**-8
    excess = ((out.float() - reference).abs() - bound).max()
    assert excess <= 0, f"an output is {float(excess):.3g} past its bound"


@pytest.mark.parametrize("kind", quant_cpu.KERNEL_TYPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_bias", [True, False])
def test_many_rows_run_in_bfloat16_within_its_bound(lib, layout, kind, dtype, with_bias):
    # the bfloat16 path itself, at a row count `linear` sends there on the decoded path (bfloat16 without a
    # bias: the GEMM writes the output itself)
    cols, rows_in = 512, quant_cpu.DEQUANTIZE_FROM_ROWS + 5
    packed = gguf_blocks(kind, 37, cols, seed=13)
    x = torch.randn(rows_in, cols, generator=torch.Generator().manual_seed(14)).to(dtype)
    bias = torch.randn(37, generator=torch.Generator().manual_seed(15)) if with_bias else None
    out = quant_cpu.dequantized_linear(x, *laid_out(layout, kind, packed, cols, lib), cols, bias, library=lib)
    assert out.shape == (rows_in, 37) and out.dtype == dtype
    assert_within_bfloat16_bound(out, packed, kind, x, bias)


def amx_tiles(kind: str, cols: int, lib) -> tuple[torch.Tensor, torch.Tensor, str]:
    """(file blocks, blocks in the kernel layout, its kind) of random weights where the library has AMX tiles
    for them."""
    packed = gguf_blocks(kind, 37, cols, seed=31)  # 37 rows: two groups of 16 and a partial one of 5
    held, held_kind = laid_out("kernel layout", kind, packed, cols, lib)
    if not quant_cpu.tiles(held_kind, cols, lib):
        pytest.skip("no AMX tiles in this build (the CPU has no AMX, or the kind is not interleaved)")
    return packed, held, held_kind


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cols", [768, 16384])
def test_amx_tiles_run_in_bfloat16_within_its_bound_each_row_as_alone(lib, kind, dtype, cols):
    # 70 activation rows: four tiles of 16 share each weight tile, then two more rows; every output within
    # the bfloat16 bound, each row's bits as a one-row call gives them (what speculation relies on). At
    # 16384 values a row a thread dequantizes 2 groups at a time: the 3 groups go as 2 chunks
    packed, held, held_kind = amx_tiles(kind, cols, lib)
    x = torch.randn(70, cols, generator=torch.Generator().manual_seed(32)).to(dtype)
    bias = torch.randn(37, generator=torch.Generator().manual_seed(33))
    out = quant_cpu.tile_linear(x, held, held_kind, cols, bias, library=lib)
    assert out.shape == (70, 37) and out.dtype == dtype
    assert_within_bfloat16_bound(out, packed, kind, x, bias)
    for row in (0, 17, 63, 69):
        alone = quant_cpu.tile_linear(x[row : row + 1], held, held_kind, cols, bias, library=lib)
        assert torch.equal(out[row], alone[0])


def test_decode_and_prefill_rows_run_on_amx_tiles_from_the_crossover(lib):
    # from TILES_FROM_ROWS rows, a step's decodes and its prefill chunks alike go to the tiles (here into a
    # column slice of a wider output); fewer decode rows beside a chunk stay on the integer kernel, apart
    cols = 512
    packed, held, held_kind = amx_tiles("Q4_K", cols, lib)
    rows_in = quant_cpu.TILES_FROM_ROWS + 3
    assert quant_cpu.path(held_kind, cols, rows_in, lib) == "tiles"
    assert quant_cpu.path(held_kind, cols, rows_in - 4, lib) == "integer"
    x = torch.randn(2 * rows_in, cols, generator=torch.Generator().manual_seed(34))
    wide = torch.full((rows_in, 45), 7.0)
    quant_cpu.linear(x[:rows_in], held, held_kind, cols, out=wide[:, 4:41], library=lib, decode_rows=rows_in)
    assert torch.equal(wide[:, 4:41], quant_cpu.tile_linear(x[:rows_in], held, held_kind, cols, library=lib))
    assert_within_bfloat16_bound(wide[:, 4:41], packed, "Q4_K", x[:rows_in])
    assert torch.equal(wide[:, :4], torch.full((rows_in, 4), 7.0))
    assert torch.equal(wide[:, 41:], torch.full((rows_in, 4), 7.0))
    as_prefill = quant_cpu.linear(x[:rows_in], held, held_kind, cols, library=lib)
    assert torch.equal(as_prefill, wide[:, 4:41])
    both_on_tiles = quant_cpu.tile_linear(x, held, held_kind, cols, library=lib)  # decodes beside a chunk: one call
    assert torch.equal(both_on_tiles[:rows_in], as_prefill)
    assert torch.equal(quant_cpu.linear(x, held, held_kind, cols, library=lib, decode_rows=rows_in), both_on_tiles)
    mixed = quant_cpu.linear(x, held, held_kind, cols, library=lib, decode_rows=5)
    assert torch.equal(mixed[:5], quant_cpu.integer_linear(x[:5], held, held_kind, cols, library=lib))
    assert torch.equal(mixed[5:], quant_cpu.tile_linear(x[5:], held, held_kind, cols, library=lib))


def test_bfloat16_path_in_slices_of_the_weight_into_an_output_slice(lib, monkeypatch):
    # a scratch of 5 rows: 37 weight rows in 8 slices (the last one partial), as an LM head goes
    monkeypatch.setattr(quant_cpu, "SCRATCH_VALUES", 5 * 256)
    kind, cols = "Q4_K", 256
    rows_in = quant_cpu.leaves_integer_at(kind, cols, lib)
    packed = gguf_blocks(kind, 37, cols, seed=16)
    x = torch.randn(rows_in, cols, generator=torch.Generator().manual_seed(17))
    wide = torch.full((rows_in, 45), 7.0)
    quant_cpu.linear(x, packed, kind, cols, out=wide[:, 4:41], library=lib)
    reference = quant_cpu.reference_linear(x, packed, kind)
    assert ((wide[:, 4:41] - reference).abs() <= bfloat16_bound(dequantized(packed, kind), x, reference)).all()
    assert torch.equal(wide[:, :4], torch.full((rows_in, 4), 7.0))
    assert torch.equal(wide[:, 41:], torch.full((rows_in, 4), 7.0))


@pytest.mark.parametrize("kind", ["Q4_K", "Q8_0"])
def test_bfloat16_activations_give_bfloat16_outputs(lib, kind):
    packed = gguf_blocks(kind, 20, 256, seed=3)
    x = torch.randn(2, 256, generator=torch.Generator().manual_seed(4)).bfloat16()
    out = quant_cpu.linear(x, packed, kind, 256, library=lib)
    assert out.dtype == torch.bfloat16
    reference = quant_cpu.reference_linear(x, packed, kind)
    # bfloat16 rounding of the output adds up to 2^-8 of each value
    bound = activation_bound(dequantized(packed, kind), x, quant_cpu.activation_block(kind, 256, lib))
    bound = bound + reference.abs() / 256 + 1e-5
    assert ((out.float() - reference).abs() <= bound).all()


@pytest.mark.parametrize("kind", quant_cpu.KERNEL_TYPES)
def test_dequantized_rows_equal_the_gguf_package(lib, layout, kind):
    cols = 576 if quant_cpu.block_values(kind) == 32 else 512  # 576: 16 blocks of 32 and 2 more
    packed = gguf_blocks(kind, 30, cols, seed=9)
    held, held_kind = laid_out(layout, kind, packed, cols, lib)
    ids = torch.tensor([29, 0, 7, 7, 13])
    rows = quant_cpu.dequantize_rows(held, held_kind, ids, cols, library=lib)
    assert torch.equal(rows, dequantized(packed, kind)[ids])
    as_bf16 = quant_cpu.dequantize_rows(held, held_kind, ids, cols, torch.bfloat16, library=lib)
    assert torch.equal(as_bf16, dequantized(packed, kind)[ids].bfloat16())


def test_a_row_id_past_the_table_is_refused(lib):
    packed = gguf_blocks("Q8_0", 4, 64)
    with pytest.raises(IndexError, match="outside the packed table"):
        quant_cpu.dequantize_rows(packed, "Q8_0", torch.tensor([1, 4]), 64, library=lib)


def test_rows_that_do_not_fill_a_block_are_refused(lib):
    packed = gguf_blocks("Q4_K", 4, 256)
    with pytest.raises(ValueError, match="no packed kernel for Q4_K rows of 128 values"):
        quant_cpu.linear(torch.randn(1, 128), packed, "Q4_K", 128, library=lib)
