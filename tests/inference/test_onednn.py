"""inference/layers/onednn.py: packed oneDNN GEMMs equal F.linear, and the engine uses them on CPU."""

import pytest
import torch
import torch.nn.functional as F

from inference import LLM
from inference.layers import onednn
from inference.layers.embedding import ParallelLMHead
from inference.layers.linear import ColumnParallelLinear, LinearBase
from inference.loader import process_weights_after_loading


def _layer(dtype, bias):
    layer = ColumnParallelLinear(96, 160, bias=bias, dtype=dtype)
    gen = torch.Generator().manual_seed(0)
    layer.weight.data.copy_(torch.randn(160, 96, generator=gen))
    if bias:
        layer.bias.data.copy_(torch.randn(160, generator=gen))
    return layer


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_packed_linear_equals_dense(dtype, tol, bias):
    layer = _layer(dtype, bias)
    dense_w = layer.weight.data.clone()
    dense_b = None if layer.bias is None else layer.bias.data.clone()
    process_weights_after_loading(layer)
    assert layer.weight.is_mkldnn and layer.weight.shape == (160, 96) and layer.weight.dtype == dtype
    for rows in (0, 1, 7, 300):
        x = torch.randn(rows, 96).to(dtype)
        with torch.inference_mode():
            out = layer(x)
        torch.testing.assert_close(out.float(), F.linear(x, dense_w, dense_b).float(), atol=tol * 10, rtol=tol)


def test_an_input_with_room_for_the_padded_rows_is_read_in_place(monkeypatch):
    """Kernel outputs come from empty_rows: the GEMM reads their storage at the padded row count
    (no F.pad copy), whatever the rows past the input hold, and gives the dense result."""
    layer = _layer(torch.float32, bias=True)
    dense_w, dense_b = layer.weight.data.clone(), layer.bias.data.clone()
    process_weights_after_loading(layer)
    rows = 300
    assert onednn.padded_rows(rows) == 320
    x = onednn.empty_rows(rows, 96, like=dense_w)
    assert x.shape == (rows, 96) and x.untyped_storage().nbytes() == 320 * 96 * 4
    x.copy_(torch.randn(rows, 96))
    torch.as_strided(x, (320, 96), (96, 1))[rows:] = float("nan")  # past the input: never in its output
    copies, pad = [], F.pad
    monkeypatch.setattr(torch.nn.functional, "pad", lambda *a, **k: copies.append(a) or pad(*a, **k))
    with torch.inference_mode():
        out = layer(x)
    assert copies == [] and out.shape == (rows, 160)
    torch.testing.assert_close(out, F.linear(x, dense_w, dense_b), atol=1e-4, rtol=1e-5)
    with torch.inference_mode():
        layer(x.clone())  # an exact-size tensor is still padded by a copy
    assert len(copies) == 1


def test_lm_head_keeps_dense_weight_and_packs_a_copy():
    head = ParallelLMHead(64, 32, torch.float32)
    head.weight.data.copy_(torch.randn(64, 32))
    process_weights_after_loading(head)
    assert not head.weight.is_mkldnn and head.packed is not None and head.packed.is_mkldnn
    x = torch.randn(5, 32)
    with torch.inference_mode():
        torch.testing.assert_close(head.logits(x), F.linear(x, head.weight), atol=1e-5, rtol=1e-5)


def test_off_switch_and_other_dtypes_stay_dense(monkeypatch):
    assert not onednn.can_pack(torch.zeros(4, 4, dtype=torch.float16))
    monkeypatch.setenv("TESSERA_ONEDNN_LINEAR", "0")
    layer = _layer(torch.float32, bias=False)
    process_weights_after_loading(layer)
    assert not layer.weight.is_mkldnn


def test_engine_on_cpu_runs_every_dense_linear_packed(tiny_model_dir):
    llm = LLM(model=tiny_model_dir, dtype="float32", num_kv_blocks=64, max_model_len=256)
    model = llm.llm_engine.model
    linears = [m for m in model.modules() if isinstance(m, LinearBase)]
    assert linears and all(m.weight.is_mkldnn for m in linears)
    assert model.lm_head.packed is not None
    # The memory breakdown still counts the weights once (packing replaces the dense copy).
    dense = sum(m.weight.numel() * 4 for m in linears)
    assert llm.llm_engine.memory["weights_bytes"] >= dense


def test_row_counts_are_every_padded_size_up_to_the_limit():
    counts = onednn.row_counts(2048)
    assert counts == sorted(set(counts)) and len(counts) == 72
    assert all(onednn.padded_rows(rows) in counts for rows in range(1, 2049))
    assert counts[:16] == list(range(1, 17)) and counts[-1] == 2048


def test_start_up_runs_every_gemm_shape_at_every_row_count_before_any_request(tiny_model_dir, monkeypatch):
    """The engine builds oneDNN's primitives at load (a first call of a shape costs milliseconds)."""
    warmed = set()
    real_linear = onednn.linear

    def recording(x, packed, bias=None):
        warmed.add((tuple(packed.shape), bias is not None, onednn.padded_rows(x.shape[0])))
        return real_linear(x, packed, bias)

    monkeypatch.setattr(onednn, "linear", recording)
    llm = LLM(
        model=tiny_model_dir,
        dtype="float32",
        num_kv_blocks=64,
        max_model_len=256,
        max_num_batched_tokens=200,
        max_num_seqs=12,
    )
    model = llm.llm_engine.model
    shapes = {(tuple(m.weight.shape), m.bias is not None) for m in model.modules() if isinstance(m, LinearBase)}
    expected = {(shape, bias, rows) for shape, bias in shapes for rows in onednn.row_counts(200)}
    expected |= {(tuple(model.lm_head.packed.shape), False, rows) for rows in onednn.row_counts(12)}
    assert warmed == expected
    # Serving calls what was built: any step's GEMMs are at row counts already warmed.
    warmed.clear()
    llm.generate([{"prompt_token_ids": list(range(3, 60))}] * 3, use_tqdm=False)
    assert warmed <= expected
