"""The demo-model trainer: a few steps of a tiny config give a folder that HF and our engine both load."""
import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from inference.demo import COMPLETE_MARKER, REQUIRED_FILES, ensure_demo_model, is_complete
from inference.demo.tokenizer import CHAT_TEMPLATE, build_tokenizer, english_corpus
from inference.demo.train import DemoConfig

TINY = DemoConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  seq_len=64, batch_size=4, steps=3, minutes=2, warmup_steps=1, threads=1)


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory):
    return ensure_demo_model(tmp_path_factory.mktemp("demo") / "tessera-demo", TINY, progress=False)


def test_corpus_is_english_prose_from_the_standard_library():
    docs = english_corpus()
    assert len(docs) > 50
    assert sum(map(len, docs)) > 300_000
    assert any(doc.startswith('The "assert" statement') for doc in docs)


def test_tokenizer_round_trips_text_and_renders_the_chat_template(tmp_path):
    tokenizer = build_tokenizer(english_corpus()[:20], 400, tmp_path)
    text = "The for statement iterates over a list. Ünïcode too!"
    ids = tokenizer.encode(text)
    assert ids[0] == tokenizer.bos_token_id
    assert tokenizer.decode(ids, skip_special_tokens=True) == text
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert rendered == "<|bos|><|system|>\nBe brief.<|eos|>\n<|user|>\nHi<|eos|>\n<|assistant|>\n"
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert config["chat_template"] == CHAT_TEMPLATE
    special = json.loads((tmp_path / "special_tokens_map.json").read_text())
    assert special["eos_token"] == "<|eos|>" and special["pad_token"] == "<|pad|>"


def test_role_markers_are_single_special_tokens(tmp_path):
    tokenizer = build_tokenizer(english_corpus()[:5], 300, tmp_path)
    for marker in ("<|user|>", "<|assistant|>", "<|system|>", "<|eos|>"):
        assert len(tokenizer.encode(marker, add_special_tokens=False)) == 1


def test_trained_folder_is_complete_and_cached(demo_dir):
    assert is_complete(demo_dir)
    assert all((demo_dir / name).exists() for name in REQUIRED_FILES)
    record = json.loads((demo_dir / COMPLETE_MARKER).read_text())
    assert record["steps"] == TINY.steps and record["final_loss"] > 0
    stamp = (demo_dir / "model.safetensors").stat().st_mtime_ns
    ensure_demo_model(demo_dir, TINY, progress=False)  # second call: nothing retrained
    assert (demo_dir / "model.safetensors").stat().st_mtime_ns == stamp
    assert not demo_dir.with_name(demo_dir.name + ".partial").exists()


def test_loads_through_hf_transformers_and_generates(demo_dir):
    tokenizer = AutoTokenizer.from_pretrained(demo_dir)
    model = AutoModelForCausalLM.from_pretrained(demo_dir)
    assert model.config.model_type == "llama"
    assert model.config.eos_token_id == tokenizer.eos_token_id
    assert len(tokenizer) == model.config.vocab_size
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Tell me about lists."}],
                                           add_generation_prompt=True, return_tensors="pt", return_dict=True)
    out = model.generate(**prompt, max_new_tokens=5, do_sample=False)
    assert out.shape[1] == prompt["input_ids"].shape[1] + 5 or tokenizer.eos_token_id in out[0].tolist()


def test_loads_through_our_engine_with_outputs_equal_to_hf(demo_dir):
    inference = pytest.importorskip("inference")
    if not hasattr(inference, "LLM"):
        pytest.skip("the engine (inference.LLM) is not in this checkout yet")
    llm = inference.LLM(model=str(demo_dir), dtype="float32", device="cpu", max_model_len=256, seed=0)
    prompt = "The assert statement"
    [result] = llm.generate([prompt], inference.SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    tokenizer = AutoTokenizer.from_pretrained(demo_dir)
    model = AutoModelForCausalLM.from_pretrained(demo_dir, dtype=torch.float32)
    ids = tokenizer(prompt, return_tensors="pt")
    hf = model.generate(**ids, max_new_tokens=8, do_sample=False, min_new_tokens=8)
    assert list(result.outputs[0].token_ids) == hf[0, ids["input_ids"].shape[1]:].tolist()
    assert llm.llm_engine.tokenizer.chat_template == CHAT_TEMPLATE
