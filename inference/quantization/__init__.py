"""Quantized weight formats as LinearMethods (see inference/layers/linear.py for the interface).

- "int8": weight-only, per output channel, quantized while a float checkpoint loads.
- "gptq" / "awq": 4-bit checkpoints whose config.json carries a quantization_config; detected
  automatically, or named with quantization="gptq" / "awq" (which must then match the folder).
- "gguf": a GGUF file's quantized matrices kept as its blocks (engine option weights="packed", the
  default for GGUF files on CPU), multiplied by the C kernels of kernels/tessera_kernels/quant_cpu.py.

Only the decoder's linear layers are quantized; embeddings, the LM head and norms stay in the
model dtype (as GPTQ and AWQ checkpoints store them). On CPU, int8, GPTQ and AWQ layers are repacked
after loading into ggml blocks and run the same C kernels as a GGUF file's (packed_int4.pack_for_cpu).
"""

from __future__ import annotations

import torch

from inference.gguf_files import is_gguf
from inference.quantization.awq import AWQLinearMethod
from inference.quantization.gguf import GGUFLinearMethod
from inference.quantization.gptq import GPTQLinearMethod
from inference.quantization.int8 import Int8LinearMethod

QUANTIZATIONS = ("int8", "gptq", "awq")
CHECKPOINT_FORMATS: dict[str, type[GPTQLinearMethod] | type[AWQLinearMethod]] = {
    "gptq": GPTQLinearMethod,
    "awq": AWQLinearMethod,
}


WEIGHT_FORMATS = ("auto", "packed", "float32", "bfloat16")


def keeps_gguf_blocks(model_config, engine_args) -> bool:
    """engine_args.weights resolved: "auto" packs a GGUF file read from disk on CPU unless dtype (or
    quantization) was set, so an explicit dtype="float32" keeps the HF-exact dequantized path."""
    weights = engine_args.weights
    if weights not in WEIGHT_FORMATS:
        raise ValueError(f"weights must be one of {', '.join(WEIGHT_FORMATS)}; got {weights!r}")
    gguf_file = is_gguf(model_config.path) and engine_args.load_format != "dummy"
    on_cpu = engine_args.device == "cpu" or (engine_args.device == "auto" and not torch.cuda.is_available())
    if weights == "packed":
        if not gguf_file or not on_cpu or engine_args.quantization is not None:
            raise ValueError(
                "weights='packed' needs a GGUF file on CPU (and no quantization=); "
                f"got {model_config.path} on {engine_args.device}"
            )
        return True
    return (
        weights == "auto" and gguf_file and on_cpu and engine_args.dtype == "auto" and engine_args.quantization is None
    )


def get_linear_method(model_config, engine_args):
    """The LinearMethod for this model and engine_args.quantization (None: plain float weights)."""
    if keeps_gguf_blocks(model_config, engine_args):
        return GGUFLinearMethod()
    asked = engine_args.quantization
    qcfg = model_config.raw.get("quantization_config")
    found = (qcfg or {}).get("quant_method")
    if asked is not None and asked not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)} or None; got {asked!r}")
    if asked == "int8":
        if qcfg:
            raise ValueError(f"quantization='int8' needs a float checkpoint; {model_config.path} is already {found!r}")
        return Int8LinearMethod()
    if found is None:
        if asked is not None:
            raise ValueError(f"quantization={asked!r} but {model_config.path}/config.json has no quantization_config")
        return None
    if found not in CHECKPOINT_FORMATS:
        raise ValueError(
            f"unsupported quant_method {found!r} in {model_config.path}/config.json; "
            f"supported: {', '.join(CHECKPOINT_FORMATS)}"
        )
    if asked is not None and asked != found:
        raise ValueError(f"quantization={asked!r} but the checkpoint in {model_config.path} is {found!r}")
    return CHECKPOINT_FORMATS[found].from_config(qcfg)


def describe_weights(model, dtype) -> dict:
    """The weights' format for the engine's memory breakdown (weights_bytes is this rank's share)."""
    method = model.layers[0].mlp.down_proj.method
    name = getattr(method, "name", None)
    return {
        "weights_dtype": getattr(method, "weight_dtype", str(dtype).removeprefix("torch.")),
        "quantization": name,
        "compute_dtype": str(dtype).removeprefix("torch."),
        "tensor_parallel_size": model.parallel.size,
    }
