"""Tiny random-weight models of each supported family, saved as ordinary HF folders.

Nothing can be downloaded, so tests build their models with transformers and load them through
the same loader real checkpoints use. Weights use a larger init than HF's default so greedy
decoding has clear winners (no near-ties that float rounding could flip).
"""
from __future__ import annotations

import functools
from pathlib import Path

import torch

from tiny_tokenizer import build_tokenizer, english_corpus

VOCAB = 512


@functools.lru_cache(maxsize=1)
def shared_tokenizer():
    return build_tokenizer(english_corpus()[:80], VOCAB)


def family_config(family: str, **overrides):
    from transformers import LlamaConfig, MistralConfig, Qwen2Config

    tok = shared_tokenizer()
    common = dict(
        vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
        initializer_range=0.15, rms_norm_eps=1e-6,
    )
    if family == "llama":
        common.update(tie_word_embeddings=False, rope_theta=10000.0)
        cls = LlamaConfig
    elif family == "llama3":  # tied embeddings and llama3 rope scaling
        common.update(tie_word_embeddings=True, rope_theta=500000.0, rope_scaling={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64})
        cls = LlamaConfig
    elif family == "mistral":
        common.update(sliding_window=None, rope_theta=1000000.0, num_key_value_heads=1)
        cls = MistralConfig
    elif family == "qwen2":
        common.update(tie_word_embeddings=True, rope_theta=1000000.0, use_sliding_window=False)
        cls = Qwen2Config
    else:
        raise ValueError(family)
    common.update(overrides)
    return cls(**common)


def make_tiny_model(out_dir: str | Path, family: str = "llama", seed: int = 0, **overrides) -> Path:
    """Save a random-weight model of family (llama / llama3 / mistral / qwen2) with its tokenizer."""
    from transformers import AutoModelForCausalLM

    out_dir = Path(out_dir)
    torch.manual_seed(seed)
    config = family_config(family, **overrides)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # qwen2's attention bias starts at zero; give it real values
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.normal_(0, 0.1)
    model.save_pretrained(out_dir, safe_serialization=True)
    shared_tokenizer().save_pretrained(out_dir)
    return out_dir


def hf_greedy(model_dir: str | Path, prompts: list[list[int]], max_new_tokens: list[int] | int) -> list[list[int]]:
    """HF transformers greedy outputs, one prompt at a time (the correctness reference)."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    if isinstance(max_new_tokens, int):
        max_new_tokens = [max_new_tokens] * len(prompts)
    outputs = []
    for ids, n in zip(prompts, max_new_tokens):
        # No EOS: generation runs the full n tokens and EOS may be generated (vLLM's ignore_eos).
        config = GenerationConfig(max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
        with torch.no_grad():
            out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                 generation_config=config)
        outputs.append(out[0, len(ids):].tolist())
    return outputs
