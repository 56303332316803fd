"""GGUF weights kept as their blocks (weights="packed", inference/quantization/gguf.py).

Tiny random models written as llama.cpp writes them, one matrix per tensor type, loaded twice
from the same file: packed, and dequantized to float32 (the HF-exact path test_gguf.py checks).
Packed layers are not bit-equal to float32 ones (the activations go through int8); each output
must be within the bound that rounding allows (tests/kernels/test_quant_cpu.py states it), plus,
for types converted to Q8_0 at load, the bound of that weight rounding (half a Q8_0 step a weight).
"""

from __future__ import annotations

import pytest
import torch
from packed_bounds import activation_bound, layer_activation_bound
from safetensors.torch import load_file
from test_gguf import ENGINE, PROMPTS, write_gguf
from tiny_models import chosen_logprobs, make_tiny_model

from inference import LLM, SamplingParams
from inference.gguf_loader import metadata, open_gguf, supported_types
from inference.layers.linear import LinearBase
from tessera_kernels import quant_cpu

# Every type the file below can hold: the ten kernel types, three converted to Q8_0 at load
# (the gguf package quantizes TQ1_0, TQ2_0 and MXFP4; it has no quantizer for the IQ types, which
# take the same conversion) and the float types, which stay dense.
EVERY_TYPE = (
    "Q4_0",
    "Q4_1",
    "Q5_0",
    "Q5_1",
    "Q8_0",
    "Q2_K",
    "Q3_K",
    "Q4_K",
    "Q5_K",
    "Q6_K",
    "TQ1_0",
    "TQ2_0",
    "MXFP4",
    "F16",
    "BF16",
    "F32",
)
CONVERTED = ("TQ1_0", "TQ2_0", "MXFP4")
PACKED = {k: v for k, v in ENGINE.items() if k != "dtype"}  # dtype unset: "auto" weights pack a GGUF file


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TESSERA_CACHE_DIR", str(tmp_path / "cache"))


@pytest.fixture(scope="module")
def every_type_file(tmp_path_factory):
    """A 2-layer llama (256 wide: K-quant blocks hold 256 values) whose 16 matrices take the 16 types."""
    root = tmp_path_factory.mktemp("every-type")
    hf_dir = make_tiny_model(root / "hf", "llama", hidden_size=256, intermediate_size=256)
    return write_gguf(hf_dir, root / "tiny-every-type.gguf", EVERY_TYPE)


@pytest.fixture(scope="module")
def both_engines(every_type_file, tmp_path_factory):
    with pytest.MonkeyPatch.context() as env:
        env.setenv("TESSERA_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))
        packed = LLM(model=str(every_type_file), **PACKED)
        dense = LLM(model=str(every_type_file), **ENGINE)
        yield packed, dense


def test_the_file_holds_every_type_and_each_is_one_the_loader_accepts(every_type_file):
    kinds = {t.tensor_type.name for t in open_gguf(str(every_type_file)).tensors}
    assert kinds == set(EVERY_TYPE)
    assert set(EVERY_TYPE) <= set(supported_types())
    assert {"IQ2_XXS", "IQ3_S", "IQ4_XS", "IQ1_M", "NVFP4"} <= set(supported_types())  # dequantized by gguf too


def dense_weight(layer) -> torch.Tensor:
    weight = layer.weight
    return (weight.to_dense() if weight.is_mkldnn else weight).float()


def conversion_bound(weight: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Q8_0 of a weight moves each value by at most half a step, max|w| of its block / 254."""
    step = weight.reshape(weight.shape[0], -1, 32).abs().amax(-1).repeat_interleave(32, -1) / 254
    return x.abs().float() @ step.T


def test_the_packed_engine_keeps_blocks_and_says_so(both_engines, every_type_file):
    packed, dense = (llm.llm_engine for llm in both_engines)
    assert (packed.memory["weights_dtype"], packed.memory["quantization"]) == ("packed", "gguf")
    assert dense.memory["weights_dtype"] == "float32"
    file_bytes = sum(int(t.n_bytes) for t in open_gguf(str(every_type_file)).tensors)
    # F16/BF16 matrices stay dense in float32 (2x) and TQ/MXFP4 grow to Q8_0: still far below float32
    assert packed.memory["weights_bytes"] < 0.5 * dense.memory["weights_bytes"]
    assert packed.memory["weights_bytes"] < 3 * file_bytes
    held = {t.name: held_as(t.tensor_type.name) for t in open_gguf(str(every_type_file)).tensors}
    segments = {seg.kind for m in packed.model.modules() if isinstance(m, LinearBase) for seg in m.segments}
    matrices = {kind for name, kind in held.items() if name.startswith("blk.") and not name.endswith("norm.weight")}
    assert segments == matrices
    assert packed.model.lm_head.weight.ggml_type == held["output.weight"]
    assert packed.model.embed_tokens.weight.ggml_type == held["token_embd.weight"]


def held_as(kind: str) -> str:
    """What a matrix of `kind` becomes in a packed model: dense, converted to Q8_0, and in the layout the
    kernels read (interleaved where this machine has that kernel: quant_cpu.kernel_kind)."""
    if kind in ("F16", "BF16", "F32"):
        return "dense"
    kind = "Q8_0" if kind in CONVERTED else kind
    return quant_cpu.kernel_kind(kind)


def test_every_packed_layer_is_within_its_rounding_bound_of_float32(both_engines, every_type_file):
    packed, dense = (llm.llm_engine.model for llm in both_engines)
    kinds = {t.name: t.tensor_type.name for t in open_gguf(str(every_type_file)).tensors}
    converted_layers = {name for name, kind in kinds.items() if kind in CONVERTED}
    checked = 0
    for name, layer in packed.named_modules():
        if not isinstance(layer, LinearBase):
            continue
        reference_layer = dense.get_submodule(name)
        weight = dense_weight(reference_layer)
        x = torch.randn(5, layer.in_features, generator=torch.Generator().manual_seed(checked))
        out, reference = layer(x), reference_layer(x)
        bound = layer_activation_bound(layer, weight, x) + conversion_bound(weight, x) + 1e-5 * reference.abs().max()
        assert ((out - reference).abs() <= bound).all(), name
        checked += 1
    assert checked == 2 * 4 and converted_layers  # qkv, o, gate_up, down in each layer; some converted


def test_embedding_rows_and_logits_come_from_the_packed_tables(both_engines):
    packed, dense = (llm.llm_engine.model for llm in both_engines)
    ids = torch.tensor([3, 250, 3, 17])
    assert torch.equal(packed.embed_tokens(ids), dense.embed_tokens(ids))  # dequantized exactly, as at load
    hidden = torch.randn(3, 256, generator=torch.Generator().manual_seed(7))
    reference = dense.compute_logits(hidden)
    head = dense.lm_head.weight.float()
    block = quant_cpu.activation_block(packed.lm_head.weight.ggml_type, 256)
    bound = activation_bound(head, hidden, block) + 1e-5 * reference.abs().max()
    assert ((packed.compute_logits(hidden) - reference).abs() <= bound).all()


def test_the_packed_engine_generates_the_same_tokens_each_time(both_engines):
    packed = both_engines[0]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    first = [
        o.outputs[0].token_ids
        for o in packed.generate(prompt_token_ids=PROMPTS, sampling_params=params, use_tqdm=False)
    ]
    again = [
        o.outputs[0].token_ids
        for o in packed.generate(prompt_token_ids=PROMPTS[::-1], sampling_params=params, use_tqdm=False)
    ]
    assert all(len(o) == 10 for o in first) and first == again[::-1]


def test_a_decode_keeps_its_bits_beside_a_prefill_chunk(tmp_path, monkeypatch):
    """With the bfloat16 path taken from 12 rows, a step holding another request's 40-token prompt and twelve
    one-token requests' prompts would take it for the decode beside them too, in the body (1 + 76 rows) and
    in the LM head (1 + 13 rows of logits); the runner marks the decode rows of both, and the packed linears
    compute them apart, so a request's tokens and logprobs are the same with or without neighbours."""
    monkeypatch.setattr(quant_cpu, "DEQUANTIZE_FROM_ROWS", 12)
    monkeypatch.setattr(quant_cpu, "TILES_FROM_ROWS", 12)
    file = write_gguf(make_tiny_model(tmp_path / "hf", "llama"), tmp_path / "tiny.gguf", ("Q8_0", "Q4_1", "Q5_0"))
    engine = LLM(model=str(file), device="cpu", max_model_len=256).llm_engine
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=1)
    one_token = SamplingParams(temperature=0, max_tokens=1)  # finished by its prefill: no decode beside a's

    def decoded(neighbour: bool):
        engine.add_request(f"a-{neighbour}", {"prompt_token_ids": list(range(5, 15))}, params)
        finished, steps = {}, 0
        while engine.has_unfinished_requests():
            if neighbour and steps == 3:  # a's decodes under way: the prompts share a step with one
                engine.add_request("b", {"prompt_token_ids": list(range(20, 60))}, params)
                for i in range(12):
                    engine.add_request(f"c{i}", {"prompt_token_ids": [70 + i, 90 + i, 110 + i]}, one_token)
            finished.update((o.request_id, o.outputs[0]) for o in engine.step() if o.finished)
            steps += 1
        return finished[f"a-{neighbour}"]

    alone, beside = decoded(False), decoded(True)
    assert beside.token_ids == alone.token_ids
    assert chosen_logprobs(beside) == chosen_logprobs(alone)


def test_qwen2_tied_table_biases_and_mixed_qkv_types(tmp_path):
    # The 0.5B Qwen file's mix: Q8_0 and Q5_0 beside Q4_K / Q6_K; the tied table serves both ends.
    packed, dense = packed_and_dense(tmp_path, "qwen2", ("Q8_0", "Q5_0", "Q4_K", "Q6_K"))
    assert packed.lm_head.weight is packed.embed_tokens.weight
    assert_within_bounds(packed, dense, ("layers.0.self_attn.qkv_proj", "layers.1.mlp.gate_up_proj"))


def test_phi3_fused_tensors_stay_one_packed_weight(tmp_path):
    packed, dense = packed_and_dense(tmp_path, "phi3", ("Q4_K", "Q8_0", "Q6_K"))
    kinds = {t.name: t.tensor_type.name for t in open_gguf(str(tmp_path / "tiny-phi3.gguf")).tensors}
    fused = {"layers.0.self_attn.qkv_proj": "blk.0.attn_qkv", "layers.1.mlp.gate_up_proj": "blk.1.ffn_up"}
    for name, tensor in fused.items():
        segments = [seg.kind for seg in packed.get_submodule(name).segments]
        assert segments == [quant_cpu.kernel_kind(kinds[f"{tensor}.weight"])], name
    assert len({kinds[f"{tensor}.weight"] for tensor in fused.values()}) == 2
    assert_within_bounds(packed, dense, fused)


def test_gemma_norms_and_embedding_scale_on_the_packed_path(tmp_path):
    packed, dense = packed_and_dense(tmp_path, "gemma", ("Q8_0", "Q4_0"))  # o_proj has 128 inputs: no K-quant
    state = load_file(tmp_path / "hf" / "model.safetensors")
    norms = [name for name, _ in packed.named_parameters() if name.endswith("norm.weight")]
    assert len(norms) == 2 * 2 + 1
    for name in norms:  # the file's 1 + w, back to w and forward again: the folder's 1 + w, exactly
        assert torch.equal(packed.get_parameter(name), 1 + state[f"model.{name}"]), name
    assert float(packed.embedding_scale) == float(dense.embedding_scale) == 16.0  # sqrt(256)
    assert_within_bounds(packed, dense, ("layers.0.self_attn.qkv_proj", "layers.1.mlp.gate_up_proj"))


def packed_and_dense(tmp_path, family: str, types: tuple[str, ...]):
    """One file of `family`'s tiny model, 256 wide (a K-quant block), loaded packed and in float32."""
    hf_dir = make_tiny_model(tmp_path / "hf", family, hidden_size=256, intermediate_size=256)
    file = write_gguf(hf_dir, tmp_path / f"tiny-{family}.gguf", types)
    return LLM(model=str(file), **PACKED).llm_engine.model, LLM(model=str(file), **ENGINE).llm_engine.model


def assert_within_bounds(packed, dense, names) -> None:
    for name in names:
        layer, reference_layer = packed.get_submodule(name), dense.get_submodule(name)
        x = torch.randn(4, layer.in_features, generator=torch.Generator().manual_seed(3))
        reference = reference_layer(x)
        bound = layer_activation_bound(layer, dense_weight(reference_layer), x) + 1e-5 * reference.abs().max()
        assert ((layer(x) - reference).abs() <= bound).all(), name


# ---- the weights option -------------------------------------------------------------------------


def test_an_explicit_float_dtype_or_weights_dequantizes(every_type_file):
    as_bf16 = LLM(model=str(every_type_file), **{**PACKED, "weights": "bfloat16"}).llm_engine
    assert as_bf16.dtype == torch.bfloat16 and as_bf16.memory["weights_dtype"] == "bfloat16"
    assert as_bf16.memory["quantization"] is None


def test_weights_packed_on_a_folder_and_disagreeing_options_are_refused(tmp_path, every_type_file):
    hf_dir = make_tiny_model(tmp_path / "hf", "llama")
    with pytest.raises(ValueError, match="weights='packed' needs a GGUF file"):
        LLM(model=str(hf_dir), **{**PACKED, "weights": "packed"})
    with pytest.raises(ValueError, match="weights='bfloat16' and dtype='float32' disagree"):
        LLM(model=str(every_type_file), **{**ENGINE, "weights": "bfloat16"})
    with pytest.raises(ValueError, match="weights must be one of auto, packed, float32, bfloat16"):
        LLM(model=str(every_type_file), **{**PACKED, "weights": "int3"})


def mapped_resident_bytes(path) -> int:
    """Resident bytes of this process's mappings of `path` (/proc/self/smaps)."""
    total, inside = 0, False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            fields = line.split()
            if "-" in fields[0] and len(fields) >= 5:  # a mapping's first line: range, perms, offset, dev, inode, path
                inside = fields[-1] == str(path)
            elif inside and fields[0] == "Rss:":
                total += int(fields[1]) * 1024
    return total


def test_the_loaded_file_is_held_once_not_twice(both_engines, every_type_file):
    """Tensors are copied out of the file's mapping; the pages they were read from are unmapped again,
    and the cached header keeps no per-token values, so the process does not hold the file a second time."""
    header = open_gguf(str(every_type_file))
    tensor_bytes = sum(int(t.n_bytes) for t in header.tensors)
    assert tensor_bytes > 8 * header.data_offset  # the test file is mostly tensors
    assert mapped_resident_bytes(every_type_file) <= header.data_offset + 4096
    assert "tokenizer.ggml.tokens" not in header.fields and header.lengths["tokenizer.ggml.tokens"] > 0
    with pytest.raises(KeyError, match="load_tokenizer"):
        metadata(str(every_type_file), "tokenizer.ggml.tokens")
