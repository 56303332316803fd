"""Load a model from a local Hugging Face folder (config.json, *.safetensors, tokenizer files)."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm.auto import tqdm

from inference.config import ModelConfig
from inference.layers.linear import copy_checked
from inference.models.llama import LlamaForCausalLM

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")
IGNORED_WEIGHTS = ("rotary_emb.inv_freq",)


def check_model_folder(path: str, load_format: str) -> None:
    """Fail early with a message that names what is missing."""
    folder = Path(path)
    missing = []
    if not (folder / "config.json").exists():
        missing.append("config.json")
    if load_format != "dummy" and not weight_files(folder):
        missing.append("*.safetensors weights")
    if not any((folder / name).exists() for name in TOKENIZER_FILES):
        missing.append("tokenizer files (one of " + ", ".join(TOKENIZER_FILES) + ")")
    if missing:
        raise FileNotFoundError(f"model folder {folder} is missing: {', '.join(missing)}")


def weight_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.exists():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        absent = [s for s in shards if not (folder / s).exists()]
        if absent:
            raise FileNotFoundError(f"model folder {folder} is missing shards: {', '.join(absent)}")
        return [folder / s for s in shards]
    return sorted(folder.glob("*.safetensors"))


def build_model(cfg: ModelConfig, ops, dtype, device, max_position: int, linear_method=None) -> LlamaForCausalLM:
    with torch.device(device):
        return LlamaForCausalLM(cfg, ops, dtype, max(max_position, cfg.max_position_embeddings), linear_method)


def load_weights(model: LlamaForCausalLM, folder: str, progress: bool = True) -> None:
    """Stream every checkpoint tensor through its parameter's weight_loader."""
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    files = weight_files(Path(folder))
    for file in tqdm(files, desc="Loading safetensors shards", disable=not progress or len(files) < 2):
        with safe_open(str(file), framework="pt") as f:
            for hf_name in f.keys():
                if hf_name.endswith(IGNORED_WEIGHTS):
                    continue
                name, shard_id = model.checkpoint_name(hf_name)
                if name == "lm_head.weight" and model.cfg.tie_word_embeddings:
                    continue
                param = params.get(name)
                if param is None:
                    raise ValueError(f"checkpoint tensor {hf_name!r} has no matching parameter in {type(model).__name__}")
                loader = getattr(param, "weight_loader", default_weight_loader)
                loader(param, f.get_tensor(hf_name).to(param.dtype), shard_id)
                loaded.add(name)
    missing = [n for n in params if n not in loaded and not (n == "lm_head.weight" and model.cfg.tie_word_embeddings)]
    if missing:
        raise ValueError(f"checkpoint in {folder} lacks weights for: {', '.join(sorted(missing)[:8])}")
    for module in model.modules():
        method = getattr(module, "method", None)
        if method is not None:
            method.process_weights_after_loading(module)


def default_weight_loader(param, loaded, shard_id=None) -> None:
    copy_checked(param.data, loaded)


def init_dummy_weights(model: LlamaForCausalLM, seed: int) -> None:
    """Random weights of the right shapes (benchmarks of real model sizes without a checkpoint)."""
    gen = torch.Generator().manual_seed(seed)
    for name, param in model.named_parameters():
        if "norm" in name:
            param.data.fill_(1.0)
        else:
            values = torch.randn(param.shape, generator=gen) * 0.02
            param.data.copy_(values.to(param.dtype))


def load_tokenizer(path: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)
