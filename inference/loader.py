"""Load a model from a local Hugging Face folder (config.json, *.safetensors, tokenizer files) or a GGUF file."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from tqdm.auto import tqdm

from inference import gguf_loader
from inference.config import ModelConfig
from inference.distributed import SINGLE, ParallelConfig
from inference.gguf_files import is_gguf
from inference.layers import onednn
from inference.layers.embedding import ParallelLMHead
from inference.layers.linear import LinearBase, copy_checked
from inference.models.llama import LlamaForCausalLM

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")
IGNORED_WEIGHTS = ("rotary_emb.inv_freq",)
# Chat models end a turn with these; each one in the vocabulary is a stop token (as vLLM's
# generation_config eos lists make them), whatever the config's single eos_token_id says.
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<end_of_turn>", "<|endoftext|>")


def check_model_path(path: str, load_format: str) -> None:
    """Fail early with a message that names what is missing or unsupported."""
    if is_gguf(path):
        gguf_loader.architecture(path)  # also checks the file exists
        if load_format != "dummy":
            gguf_loader.check_tensor_types(path)
        return
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


def build_model(
    cfg: ModelConfig, ops, dtype, device, max_position: int, linear_method=None, parallel: ParallelConfig = SINGLE
) -> LlamaForCausalLM:
    with torch.device(device):
        return LlamaForCausalLM(
            cfg, ops, dtype, max(max_position, cfg.max_position_embeddings), linear_method, parallel
        )


def load_weights(model: Any, path: str, progress: bool = True) -> None:
    """Stream every checkpoint tensor through its parameter's weight_loader."""
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    for hf_name, tensor in checkpoint_tensors(model, path, progress):
        if hf_name.endswith(IGNORED_WEIGHTS + getattr(model, "ignored_weights", ())):
            continue
        name, shard_id = model.checkpoint_name(hf_name)
        if name == "lm_head.weight" and model.cfg.tie_word_embeddings:
            continue
        param = params.get(name)
        if param is None:
            raise ValueError(f"checkpoint tensor {hf_name!r} has no matching parameter in {type(model).__name__}")
        loader = getattr(param, "weight_loader", default_weight_loader)
        loader(param, as_param_dtype(tensor(), param), shard_id)
        loaded.add(name)
    missing = [
        name for name, param in params.items() if name not in loaded and not not_in_checkpoint(model, name, param)
    ]
    if missing:
        raise ValueError(f"checkpoint in {path} lacks weights for: {', '.join(sorted(missing)[:8])}")
    process_weights_after_loading(model)


def checkpoint_tensors(model, path: str, progress: bool):
    """(HF name, a function giving the tensor) from the safetensors shards or a GGUF file.

    Ignored tensors are never read: the function is only called for tensors the model takes.
    """
    if is_gguf(path):
        total = len(gguf_loader.open_gguf(path).tensors)
        packed = keeps_gguf_blocks(model)
        tensors = gguf_loader.iter_weights(path, model.cfg, packed)
        desc = "Reading GGUF tensors" if packed else "Dequantizing GGUF tensors"
        for hf_name, tensor in tqdm(tensors, total=total, desc=desc, disable=not progress):
            yield hf_name, lambda t=tensor: t
        return
    files = weight_files(Path(path))
    for file in tqdm(files, desc="Loading safetensors shards", disable=not progress or len(files) < 2):
        with safe_open(str(file), framework="pt") as f:
            for hf_name in f.keys():
                yield hf_name, lambda f=f, name=hf_name: f.get_tensor(name)


def process_weights_after_loading(model) -> None:
    for module in model.modules():
        method = getattr(module, "method", None)
        if method is not None:
            method.process_weights_after_loading(module)
        elif hasattr(module, "process_weights_after_loading"):
            module.process_weights_after_loading()


def keeps_gguf_blocks(model) -> bool:
    """Whether the model's linear layers take GGUF blocks as they are (weights="packed")."""
    return any(getattr(getattr(module, "method", None), "name", None) == "gguf" for module in model.modules())


def as_param_dtype(tensor: torch.Tensor, param) -> torch.Tensor:
    """Floats arrive in the parameter's dtype; packed integers and floats bound for int8 as they are."""
    if isinstance(tensor, torch.Tensor) and tensor.is_floating_point() and param.is_floating_point():
        tensor = tensor.to(param.dtype)
    return tensor


def not_in_checkpoint(model, name: str, param) -> bool:
    """Parameters a checkpoint need not hold: tied heads, values derived at load, optional ones."""
    if name == "lm_head.weight" and model.cfg.tie_word_embeddings:
        return True
    return getattr(param, "derived", False) or getattr(param, "optional", False)


def load_model(
    args,
    cfg: ModelConfig,
    ops,
    dtype,
    device,
    max_model_len: int,
    progress: bool = True,
    parallel: ParallelConfig = SINGLE,
):
    """This rank's shard (`parallel`) of the model: built with the linear method of args.quantization, then loaded."""
    from inference.quantization import get_linear_method

    model = build_model(cfg, ops, dtype, device, max_model_len, get_linear_method(cfg, args), parallel)
    if args.load_format == "dummy":
        init_dummy_weights(model, args.seed)
        process_weights_after_loading(model)
    else:
        load_weights(model, args.model, progress)
    onednn.warm_up(packed_gemms(model, max_rows=args.max_num_batched_tokens, max_logit_rows=args.max_num_seqs))
    return model.eval()


def packed_gemms(model, *, max_rows: int, max_logit_rows: int) -> list[tuple]:
    """(oneDNN-packed weight, bias, most rows) of every linear layer and of the logits GEMM."""
    gemms = []
    for module in model.modules():
        weight = getattr(module, "weight", None)  # quantized formats hold other parameters
        if isinstance(module, LinearBase) and weight is not None and weight.is_mkldnn:
            gemms.append((weight, module.bias, max_rows))
        elif isinstance(module, ParallelLMHead) and module.packed is not None:
            gemms.append((module.packed, None, max_logit_rows))
    return gemms


def default_weight_loader(param, loaded, shard_id=None) -> None:
    copy_checked(param.data, loaded)


def init_dummy_weights(model: Any, seed: int) -> None:
    """Random weights of the right shapes (benchmarks of real model sizes without a checkpoint)."""
    gen = torch.Generator().manual_seed(seed)
    for name, param in model.named_parameters():
        if "norm" in name:
            param.data.fill_(1.0)
        elif name.endswith("g_idx"):
            param.data.zero_()  # every input in group 0: always a valid group
        elif not param.is_floating_point():  # quantized: random codes
            info = torch.iinfo(param.dtype)
            param.data.copy_(torch.randint(info.min, info.max, param.shape, generator=gen, dtype=param.dtype))
        else:
            values = torch.randn(param.shape, generator=gen) * 0.02
            param.data.copy_(values.to(param.dtype))


def load_tokenizer(path: str):
    """The one way every process (engine, web tier, Celery) gets the model's tokenizer."""
    if is_gguf(path):
        tokenizer = gguf_loader.load_tokenizer(path)
    else:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(path)
    return without_construction_tables(tokenizer)


# transformers' per-model tokenizer classes (Qwen2, Llama, GPT-2) keep the Python vocabulary and merge
# list they built the Rust tokenizer from; nothing reads them after __init__, and for a large vocabulary
# they are most of the tokenizer's memory in every process that loads it (docs/benchmarks.md)
CONSTRUCTION_TABLES = ("_vocab", "_merges")


def without_construction_tables(tokenizer):
    for name in CONSTRUCTION_TABLES:
        tokenizer.__dict__.pop(name, None)
    return tokenizer


def tokenize_prompt(tokenizer, prompt) -> tuple[str | None, list[int]]:
    """An engine prompt as (its text if known, its token ids): text, or {"prompt_token_ids": [...]}
    (optionally with "prompt" text too)."""
    if isinstance(prompt, str):
        return prompt, tokenizer.encode(prompt, add_special_tokens=True)
    if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
        return prompt.get("prompt"), list(prompt["prompt_token_ids"])
    raise ValueError("prompt must be a string or a dict with 'prompt_token_ids'")


def end_of_turn_token_ids(tokenizer) -> set[int]:
    """The tokenizer's EOS and every END_OF_TURN_TOKENS entry its vocabulary holds."""
    vocab = tokenizer.get_vocab()
    found = {vocab[token] for token in END_OF_TURN_TOKENS if token in vocab}
    return found | ({tokenizer.eos_token_id} - {None})
