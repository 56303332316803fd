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
    from transformers import GemmaConfig, LlamaConfig, MistralConfig, Phi3Config, Qwen2Config

    tok = shared_tokenizer()
    common = dict(
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        initializer_range=0.15,
        rms_norm_eps=1e-6,
    )
    if family == "llama":
        common.update(tie_word_embeddings=False, rope_theta=10000.0)
        cls = LlamaConfig
    elif family == "llama3":  # tied embeddings and llama3 rope scaling
        common.update(
            tie_word_embeddings=True,
            rope_theta=500000.0,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        )
        cls = LlamaConfig
    elif family == "mistral":
        common.update(sliding_window=None, rope_theta=1000000.0, num_key_value_heads=1)
        cls = MistralConfig
    elif family == "qwen2":
        common.update(tie_word_embeddings=True, rope_theta=1000000.0, use_sliding_window=False)
        cls = Qwen2Config
    elif family == "phi3":  # q, k, v and gate, up stored fused
        common.update(tie_word_embeddings=False, rope_theta=10000.0, sliding_window=None)
        cls = Phi3Config
    elif family == "gemma":
        # gelu (tanh form), scaled embeddings, norms of 1 + weight, one KV head, head_dim > hidden / heads;
        # untied here: with the table tied, the scaled input embedding decides every greedy token
        common.update(tie_word_embeddings=False, rope_theta=10000.0, num_key_value_heads=1, head_dim=32)
        cls = GemmaConfig
    else:
        raise ValueError(family)
    common.update(overrides)
    return cls(**common)


def make_tiny_model(out_dir: str | Path, family: str = "llama", seed: int = 0, **overrides) -> Path:
    """Save a random-weight model of family (llama / llama3 / mistral / qwen2 / phi3 / gemma) with its tokenizer."""
    from transformers import AutoModelForCausalLM

    out_dir = Path(out_dir)
    torch.manual_seed(seed)
    config = family_config(family, **overrides)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # qwen2's attention bias and gemma's norms start at zero; give them real values
        for name, param in model.named_parameters():
            if name.endswith("bias") or (family == "gemma" and name.endswith("norm.weight")):
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
            out = model.generate(
                torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long), generation_config=config
            )
        outputs.append(out[0, len(ids) :].tolist())
    return outputs


def make_tiny_bert(out_dir: str | Path, pooling: str = "mean", normalize: bool = True, seed: int = 0, **config) -> Path:
    """A random-weight BERT encoder saved as a sentence-transformers folder: config.json and weights,
    a WordPiece tokenizer over the corpus' most frequent words, modules.json with a Pooling module
    of `pooling` (cls / mean / max) and, if normalize, a Normalize module. Extra config.json keys
    (e.g. matryoshka_dimensions) go in through config."""
    import collections
    import json
    import re

    from transformers import BertConfig, BertModel, BertTokenizerFast

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    words = collections.Counter(w for doc in english_corpus()[:40] for w in re.findall(r"[a-z]+", doc.lower()))
    vocab = [
        "[PAD]",
        "[UNK]",
        "[CLS]",
        "[SEP]",
        "[MASK]",
        *"abcdefghijklmnopqrstuvwxyz0123456789.,;:!?'\"()-",
        *(f"##{c}" for c in "abcdefghijklmnopqrstuvwxyz"),
    ]
    vocab += [w for w, _ in words.most_common(400) if w not in vocab]
    (out_dir / "vocab.txt").write_text("\n".join(vocab) + "\n")
    BertTokenizerFast(vocab_file=str(out_dir / "vocab.txt"), do_lower_case=True).save_pretrained(out_dir)
    torch.manual_seed(seed)
    bert_config = BertConfig(
        vocab_size=len(vocab),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=128,
        initializer_range=0.15,
    )
    BertModel(bert_config).eval().save_pretrained(out_dir, safe_serialization=True)
    if config:
        raw = json.loads((out_dir / "config.json").read_text())
        (out_dir / "config.json").write_text(json.dumps({**raw, **config}, indent=2))
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
    ]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
    (out_dir / "modules.json").write_text(json.dumps(modules, indent=2))
    (out_dir / "1_Pooling").mkdir(exist_ok=True)
    modes = {"cls": "pooling_mode_cls_token", "mean": "pooling_mode_mean_tokens", "max": "pooling_mode_max_tokens"}
    (out_dir / "1_Pooling" / "config.json").write_text(
        json.dumps({"word_embedding_dimension": 64, **{key: name == pooling for name, key in modes.items()}})
    )
    (out_dir / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 96, "do_lower_case": False}))
    return out_dir


def chosen_logprobs(completion) -> list[float]:
    """Each generated token's own logprob (the request asked for logprobs): what "the same bits" compares."""
    return [entry[token].logprob for entry, token in zip(completion.logprobs, completion.token_ids)]
