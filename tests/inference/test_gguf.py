"""GGUF loading: tiny random HF models written as llama.cpp's converter writes them, in several
tensor types; our engine's greedy output must equal HF transformers loading the same file."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from tiny_models import hf_greedy, make_tiny_model

from inference import LLM, SamplingParams
from inference.gguf_files import served_model_name
from inference.gguf_loader import ARCHITECTURE_BLOCK_TENSORS, BLOCK_TENSORS, GLOBAL_TENSORS, tokenizer_cache_dir
from inference.loader import load_tokenizer

PROMPTS = [[5, 17, 42, 99, 7], [3, 250, 11], [8, 8, 9, 120, 33, 61, 2 + 40, 77]]
MAX_TOKENS = [12, 9, 10]
# A mixed file, as real ones are: each matrix takes the next type in turn; norms stay F32.
MIXED = ("Q8_0", "Q4_0", "Q4_1", "F16", "BF16", "F32")
TO_GGUF = {hf: gguf for gguf, hf in GLOBAL_TENSORS.items()}
ENGINE = dict(dtype="float32", device="cpu", max_model_len=256, num_kv_blocks=64, seed=0)


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TESSERA_CACHE_DIR", str(tmp_path / "cache"))


# Phi-3's LongRoPE in a tiny model: one factor per rotary frequency (head_dim 16: 8)
LONGROPE = {
    "rope_type": "longrope",
    "rope_theta": 10000.0,
    "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5, 3.1, 3.8],
    "long_factor": [1.0, 2.0, 4.0, 8.0, 12.0, 16.0, 24.0, 32.0],
}


# ---- writing GGUF files the way llama.cpp's convert_hf_to_gguf.py lays them out -----------------


def gguf_name(hf_name: str, arch: str) -> str:
    if hf_name in TO_GGUF:
        return TO_GGUF[hf_name]
    _, _, layer, *rest = hf_name.split(".")  # model.layers.N.self_attn.q_proj.weight
    module, kind = ".".join(rest[:-1]), rest[-1]
    parts = {**BLOCK_TENSORS, **ARCHITECTURE_BLOCK_TENSORS.get(arch, {})}
    part = next(g for g, h in parts.items() if h == module)
    return f"blk.{layer}.{part}.{kind}"


def permute(weight: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's permute() for Llama-architecture Q/K rows."""
    return (
        weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)
    )


def add_tokenizer(writer, hf_dir: Path) -> None:
    from gguf import TokenType
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(hf_dir)
    vocab = tok.get_vocab()
    tokens = sorted(vocab, key=vocab.get)
    special = set(tok.all_special_tokens)
    merges = json.loads((hf_dir / "tokenizer.json").read_text())["model"]["merges"]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([TokenType.CONTROL if t in special else TokenType.NORMAL for t in tokens])
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    writer.add_bos_token_id(tok.bos_token_id)
    writer.add_eos_token_id(tok.eos_token_id)
    writer.add_pad_token_id(tok.pad_token_id)
    writer.add_add_bos_token(True)
    writer.add_chat_template(tok.chat_template)


def write_gguf(
    hf_dir: Path,
    out: Path,
    types=MIXED,
    arch: str | None = None,
    name: str | None = None,
    sampling: dict | None = None,
) -> Path:
    """hf_dir's model as a GGUF file; matrices cycle through `types`."""
    from gguf import GGMLQuantizationType, GGUFWriter, quants

    config = json.loads((hf_dir / "config.json").read_text())
    family = config["model_type"]
    arch = arch or (family if family in ("qwen2", "phi3", "gemma") else "llama")  # llama.cpp writes Mistral as llama
    writer = GGUFWriter(str(out), arch)
    writer.add_name(name or f"tiny-{family}")
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(config.get("rope_theta") or config["rope_parameters"]["rope_theta"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_vocab_size(config["vocab_size"])
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    for key, value in (sampling or {}).items():
        getattr(writer, f"add_sampling_{key}")(value)
    add_tokenizer(writer, hf_dir)
    state = load_file(hf_dir / "model.safetensors")
    matrices = 0
    for hf_name, tensor in state.items():
        if config.get("tie_word_embeddings") and hf_name == "lm_head.weight":
            continue
        data = tensor.float().numpy()
        if arch == "llama" and hf_name.endswith(("q_proj.weight", "k_proj.weight")):
            data = permute(data, heads if "q_proj" in hf_name else kv_heads)
        if arch == "gemma" and hf_name.endswith("norm.weight"):
            data = data + 1  # llama.cpp's converter stores Gemma's norms as the multiplier 1 + w
        kind = "F32" if data.ndim == 1 else types[matrices % len(types)]
        matrices += data.ndim == 2
        if kind in K_QUANT_SCALES:
            qtype = GGMLQuantizationType[kind]
            writer.add_tensor(gguf_name(hf_name, arch), random_k_quant(data.shape, kind, matrices), raw_dtype=qtype)
        elif kind == "F32":
            writer.add_tensor(gguf_name(hf_name, arch), data)
        elif kind == "F16":
            writer.add_tensor(gguf_name(hf_name, arch), data.astype(np.float16))
        else:
            qtype = GGMLQuantizationType[kind]
            writer.add_tensor(gguf_name(hf_name, arch), quants.quantize(data, qtype), raw_dtype=qtype)
    add_longrope(writer, config)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def add_longrope(writer, config: dict) -> None:
    """LongRoPE as llama.cpp's Phi-3 converter writes it: both factor lists as F32 tensors, the original
    context and the attention factor as metadata."""
    rope = config.get("rope_parameters") or {}
    if rope.get("rope_type") != "longrope":
        return
    original = config["original_max_position_embeddings"]
    factor = config["max_position_embeddings"] / original
    writer.add_rope_scaling_orig_ctx_len(original)
    writer.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(factor) / math.log(original)))
    for kind in ("long", "short"):
        writer.add_tensor(f"rope_factors_{kind}.weight", np.array(rope[f"{kind}_factor"], dtype=np.float32))


# The gguf package dequantizes K-quants but cannot quantize them, so K-quant tensors get random
# blocks with small scales: byte offsets of each block's f16 scale(s) and the value to put there
# (d, then dmin where the type has one: it centres the values). Q8_1 is a type the package knows
# but cannot dequantize: its random bytes only serve the refusal test.
K_QUANT_SCALES = {
    "Q6_K": {208: 2e-4},
    "Q4_K": {0: 1e-3, 2: 7.5e-3},
    "Q5_K": {0: 5e-4, 2: 7.5e-3},
    "Q3_K": {108: 2e-3},
    "Q2_K": {80: 1e-2, 82: 1.5e-2},
    "Q8_1": {},
}


def random_k_quant(shape: tuple[int, int], kind: str, seed: int) -> np.ndarray:
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    block, size = GGML_QUANT_SIZES[GGMLQuantizationType[kind]]
    rows, cols = shape
    blocks = np.random.default_rng(seed).integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
    for offset, scale in K_QUANT_SCALES[kind].items():
        blocks[..., offset : offset + 2] = np.frombuffer(np.float16(scale).tobytes(), dtype=np.uint8)
    return blocks.reshape(rows, cols // block * size)


def hf_greedy_gguf(file: Path, prompts, max_tokens) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(file.parent, gguf_file=file.name, dtype=torch.float32).eval()
    outputs = []
    for ids, n in zip(prompts, max_tokens):
        with torch.no_grad():
            out = model.generate(
                torch.tensor([ids]),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                max_new_tokens=n,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )
        outputs.append(out[0, len(ids) :].tolist())
    return outputs


def engine_greedy(file: Path, prompts, max_tokens, **engine) -> list[list[int]]:
    llm = LLM(model=str(file), **{**ENGINE, **engine})
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in max_tokens]
    return [
        o.outputs[0].token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    ]


# ---- greedy parity with HF transformers ----------------------------------------------------------


@pytest.mark.parametrize(
    "family, types",
    [
        ("llama", MIXED),  # untied head, permuted Q/K, every non-K type in one file
        ("llama", ("F32",)),  # lossless: parity with the unquantized HF folder as well
        ("mistral", ("Q8_0", "F16")),  # written as "llama", told apart by general.name
        ("qwen2", ("Q4_1", "BF16")),  # Q/K/V biases, tied embeddings, no permutation
        ("phi3", ("Q8_0", "Q4_0", "F16")),  # Q/K/V and gate/up fused, one tensor each
        ("phi3", ("F32",)),
    ],
)
def test_greedy_output_equals_hf_transformers_on_the_same_gguf(tmp_path, family, types):
    hf_dir = make_tiny_model(tmp_path / "hf", family)
    file = write_gguf(hf_dir, tmp_path / f"tiny-{family}.gguf", types)
    ours = engine_greedy(file, PROMPTS, MAX_TOKENS)
    assert ours == hf_greedy_gguf(file, PROMPTS, MAX_TOKENS)
    assert all(len(o) == n for o, n in zip(ours, MAX_TOKENS))
    if types == ("F32",):
        assert ours == hf_greedy(hf_dir, PROMPTS, MAX_TOKENS)


def test_k_quants_equal_hf_transformers(tmp_path):
    """Q4_K and Q6_K blocks hold 256 values, so this model's rows are 256 wide."""
    hf_dir = make_tiny_model(tmp_path / "hf", "llama", hidden_size=256, intermediate_size=256)
    file = write_gguf(hf_dir, tmp_path / "tiny-k.gguf", ("Q4_K", "Q6_K"))
    ours = engine_greedy(file, PROMPTS, MAX_TOKENS)
    assert ours == hf_greedy_gguf(file, PROMPTS, MAX_TOKENS)
    assert len(set(tok for out in ours for tok in out)) > 3  # not one token over and over


def test_config_and_names_come_from_the_metadata(tmp_path):
    hf_dir = make_tiny_model(tmp_path / "hf", "qwen2")
    file = write_gguf(hf_dir, tmp_path / "Tiny-Qwen2-Chat.Q4_1.gguf", ("Q4_1",))
    engine = LLM(model=str(file), **ENGINE).llm_engine
    cfg, hf = engine.model_config, json.loads((hf_dir / "config.json").read_text())
    assert (cfg.architecture, cfg.family, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads) == (
        "Qwen2ForCausalLM",
        "qwen2",
        hf["num_hidden_layers"],
        hf["num_attention_heads"],
        hf["num_key_value_heads"],
    )
    assert cfg.tie_word_embeddings and cfg.attention_bias and cfg.rope_theta == hf["rope_parameters"]["rope_theta"]
    assert engine.served_model_name == "Tiny-Qwen2-Chat"
    assert hf["eos_token_id"] in engine.eos_token_ids


def test_served_names_drop_the_extension_and_the_quantization_tag():
    assert served_model_name("/x/SmolLM2-135M-Instruct.Q4_1.gguf") == "SmolLM2-135M-Instruct"
    assert served_model_name("/x/qwen2.5-0.5b-instruct-q4_k_m.gguf") == "qwen2.5-0.5b-instruct"
    assert served_model_name("/x/Mistral-7B-v0.3.F16.gguf") == "Mistral-7B-v0.3"
    assert served_model_name("/models/my-llama/") == "my-llama"


# ---- tokenizer ----------------------------------------------------------------------------------


def test_tokenizer_and_chat_template_from_metadata_are_cached_per_file(tmp_path):
    from transformers import AutoTokenizer

    hf_dir = make_tiny_model(tmp_path / "hf", "llama")
    file = write_gguf(hf_dir, tmp_path / "tiny.gguf", ("F16",))
    reference = AutoTokenizer.from_pretrained(file.parent, gguf_file=file.name)
    assert not tokenizer_cache_dir(str(file)).exists()
    built = load_tokenizer(str(file))
    assert (tokenizer_cache_dir(str(file)) / "tokenizer_config.json").exists()
    cached = load_tokenizer(str(file))
    text = "The assert statement, café and 你好 🎉"
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is a list?"}]
    for tok in (built, cached):
        assert tok.encode(text) == reference.encode(text)
        assert tok.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=False
        ) == reference.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        assert tok.eos_token_id == reference.eos_token_id


def python_tables(tokenizer, at_least: int) -> list[str]:
    """The tokenizer's attributes holding a Python dict or list of at least `at_least` entries."""
    tables = {name: value for name, value in vars(tokenizer).items() if isinstance(value, dict | list)}
    return [name for name, value in tables.items() if len(value) >= at_least]


def test_the_tokenizer_keeps_no_python_copy_of_its_vocabulary(tmp_path):
    """transformers' Qwen2 class (Qwen files' tokenizer) keeps the vocabulary and merges it built the Rust
    tokenizer from; in every process that loads a large vocabulary that copy is most of its memory."""
    from transformers import AutoTokenizer

    hf_dir = make_tiny_model(tmp_path / "hf", "qwen2")
    file = write_gguf(hf_dir, tmp_path / "tiny.gguf", ("F16",))
    from_file = AutoTokenizer.from_pretrained(file.parent, gguf_file=file.name)
    from_folder = AutoTokenizer.from_pretrained(hf_dir)
    text = "The assert statement, café and 你好 🎉"
    built, cached = load_tokenizer(str(file)), load_tokenizer(str(file))
    kept = AutoTokenizer.from_pretrained(tokenizer_cache_dir(str(file)))  # what transformers alone keeps
    assert python_tables(kept, at_least=len(kept) // 4) != []
    for tokenizer, reference in ((built, from_file), (cached, from_file), (load_tokenizer(str(hf_dir)), from_folder)):
        assert python_tables(tokenizer, at_least=len(reference) // 4) == []
        assert tokenizer.encode(text) == reference.encode(text)
        assert tokenizer.decode(reference.encode(text)) == reference.decode(reference.encode(text))
        assert tokenizer.get_vocab() == reference.get_vocab()


def test_an_unwritable_cache_only_costs_time(tmp_path, monkeypatch):
    hf_dir = make_tiny_model(tmp_path / "hf", "llama")
    file = write_gguf(hf_dir, tmp_path / "tiny.gguf", ("F16",))
    (tmp_path / "not-a-dir").write_text("")
    monkeypatch.setenv("TESSERA_CACHE_DIR", str(tmp_path / "not-a-dir"))
    assert load_tokenizer(str(file)).encode("hello") == load_tokenizer(str(hf_dir)).encode("hello")


# ---- generation defaults --------------------------------------------------------------------------


def resolved(engine, params: SamplingParams) -> SamplingParams:
    engine.add_request("r", {"prompt_token_ids": [5, 6, 7]}, params)
    resolved = engine.requests["r"].params
    engine.abort_request("r")
    return resolved


def test_gguf_sampling_metadata_gives_the_defaults_a_request_leaves_unset(tmp_path):
    hf_dir = make_tiny_model(tmp_path / "hf", "llama")
    file = write_gguf(
        hf_dir,
        tmp_path / "tiny.gguf",
        ("F16",),
        sampling={"temp": 0.3, "top_k": 20, "top_p": 0.8, "min_p": 0.05, "penalty_repeat": 1.15},
    )
    engine = LLM(model=str(file), **ENGINE).llm_engine
    unset = resolved(engine, SamplingParams())
    assert (unset.temperature, unset.top_k, unset.min_p) == (pytest.approx(0.3), 20, pytest.approx(0.05))
    assert (unset.top_p, unset.repetition_penalty) == (pytest.approx(0.8), pytest.approx(1.15))
    explicit = resolved(engine, SamplingParams(temperature=0.9, top_k=0))
    assert (explicit.temperature, explicit.top_k, explicit.top_p) == (0.9, -1, pytest.approx(0.8))


def test_generation_config_json_gives_the_defaults_and_more_stop_tokens(tmp_path):
    hf_dir = make_tiny_model(tmp_path / "hf", "llama")
    (hf_dir / "generation_config.json").write_text(
        json.dumps(
            {"temperature": 0.0, "top_p": 0.9, "repetition_penalty": 1.05, "eos_token_id": [2, 7], "do_sample": True}
        )
    )
    engine = LLM(model=str(hf_dir), **ENGINE).llm_engine
    unset = resolved(engine, SamplingParams())
    assert (unset.temperature, unset.top_p, unset.repetition_penalty, unset.top_k) == (0.0, 0.9, 1.05, -1)
    assert {2, 7} <= set(engine.eos_token_ids)
    # greedy by the model's default: the same tokens as an explicit temperature=0 request
    llm = LLM(model=str(hf_dir), **ENGINE)
    by_default = (
        llm.generate(
            prompt_token_ids=PROMPTS[:1], sampling_params=SamplingParams(max_tokens=8, ignore_eos=True), use_tqdm=False
        )[0]
        .outputs[0]
        .token_ids
    )
    assert by_default == engine_greedy(hf_dir, PROMPTS[:1], [8])[0]


def test_gemma_files_equal_hf_transformers_on_the_folder_they_came_from(tmp_path):
    # transformers reads no Gemma (1) GGUF model, so the reference is the folder, written without loss (F32)
    hf_dir = make_tiny_model(tmp_path / "hf", "gemma")
    file = write_gguf(hf_dir, tmp_path / "tiny-gemma.gguf", ("F32",))
    assert engine_greedy(file, PROMPTS, MAX_TOKENS) == hf_greedy(hf_dir, PROMPTS, MAX_TOKENS)
    text = "The quick brown fox jumps over the lazy dog."
    assert load_tokenizer(str(file)).encode(text) == load_tokenizer(str(hf_dir)).encode(text)


# ---- what is refused, at start-up, by name ----------------------------------------------------------


def test_an_unsupported_tensor_type_fails_at_start_naming_it(tmp_path):
    hf_dir = make_tiny_model(tmp_path / "hf", "llama")
    file = write_gguf(hf_dir, tmp_path / "tiny.gguf", ("F16", "Q8_1"))
    with pytest.raises(ValueError, match=r"unsupported GGUF tensor types .*Q8_1 \(e\.g\. [\w.]+\)"):
        LLM(model=str(file), **ENGINE)


def test_an_unsupported_architecture_fails_at_start_naming_it(tmp_path):
    hf_dir = make_tiny_model(tmp_path / "hf", "llama")
    file = write_gguf(hf_dir, tmp_path / "tiny.gguf", ("F16",), arch="falcon")
    with pytest.raises(ValueError, match="unsupported GGUF architecture 'falcon'"):
        LLM(model=str(file), **ENGINE)


def test_a_phi3_longrope_model_serves_its_original_context_exactly(tmp_path):
    # Phi-3.5 and Phi-3's 128k models: LongRoPE's short factors hold up to the original context (here 128 of
    # 1024 positions), where the context stops; the file carries the factors as tensors, as llama.cpp's does
    hf_dir = make_tiny_model(tmp_path / "hf", "phi3", rope_parameters=LONGROPE, original_max_position_embeddings=128)
    file = write_gguf(hf_dir, tmp_path / "tiny-phi3-longrope.gguf", ("F32",))
    prompts, max_tokens = [list(range(10, 90)), [5, 17, 42]], [40, 30]  # up to 120 positions
    reference = hf_greedy(hf_dir, prompts, max_tokens)
    for model in (hf_dir, file):
        assert engine_greedy(model, prompts, max_tokens, max_model_len=128) == reference
        with pytest.raises(ValueError, match="exceeds the model's limit of 128 positions"):
            LLM(model=str(model), **{**ENGINE, "max_model_len": 256})


def test_a_missing_file_names_the_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="missing.gguf"):
        LLM(model=str(tmp_path / "missing.gguf"), **ENGINE)
