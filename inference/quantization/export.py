"""Write GPTQ- or AWQ-format checkpoints from a float HF folder (round-to-nearest, no calibration).

Nothing can be downloaded here, so tests and benchmarks make their 4-bit folders with this: the
tensors and quantization_config follow the formats' specs (kernels/tessera_kernels/quant_ref.py), so the same
loader path reads them as it reads AutoGPTQ / AutoAWQ output.

    python -m inference.quantization.export SRC DST --format gptq --group-size 128 [--desc-act]
"""

from __future__ import annotations

import argparse
import json
import shutil
import zlib
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from tessera_kernels.quant_ref import act_order_g_idx, awq_pack, gptq_pack

LINEAR_NAMES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def is_quantized_linear(name: str) -> bool:
    return name.endswith(".weight") and name.split(".")[-2] in LINEAR_NAMES


def quantize_tensors(tensors: dict[str, torch.Tensor], fmt: str, group_size: int, desc_act: bool) -> dict:
    out = {}
    for name, tensor in sorted(tensors.items()):
        if not is_quantized_linear(name):
            out[name] = tensor.to(torch.float16) if tensor.is_floating_point() else tensor
            continue
        prefix = name.removesuffix(".weight")
        if fmt == "gptq":
            g_idx = act_order_g_idx(tensor.shape[1], group_size, seed=input_site(prefix)) if desc_act else None
            packed = gptq_pack(tensor, group_size, g_idx)
        else:
            packed = awq_pack(tensor, group_size)
        out.update({f"{prefix}.{key}": value.contiguous() for key, value in packed.items()})
    return out


def input_site(prefix: str) -> int:
    """Projections reading the same input share one act-order permutation (GPTQ orders inputs by the
    Hessian of that input), which is what lets q/k/v and gate/up be merged: one seed per input."""
    for part, shared in (("k_proj", "q_proj"), ("v_proj", "q_proj"), ("up_proj", "gate_proj")):
        prefix = prefix.replace(part, shared)
    return zlib.crc32(prefix.encode())


def quantization_config(fmt: str, group_size: int, desc_act: bool) -> dict:
    if fmt == "gptq":
        return {
            "quant_method": "gptq",
            "bits": 4,
            "group_size": group_size,
            "desc_act": desc_act,
            "sym": True,
            "checkpoint_format": "gptq",
        }
    return {"quant_method": "awq", "bits": 4, "group_size": group_size, "zero_point": True, "version": "gemm"}


def write_quantized_folder(
    src: str | Path, dst: str | Path, fmt: str = "gptq", group_size: int = 128, desc_act: bool = False
) -> Path:
    """Copy an HF folder to dst with its linear layers in `fmt` ("gptq" or "awq")."""
    if fmt not in ("gptq", "awq"):
        raise ValueError(f"format must be gptq or awq, got {fmt!r}")
    if desc_act and fmt != "gptq":
        raise ValueError("act-order (desc_act) exists only in GPTQ")
    src, dst = Path(src), Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for file in sorted(src.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            tensors.update({name: f.get_tensor(name) for name in f.keys()})
    save_file(
        quantize_tensors(tensors, fmt, group_size, desc_act), str(dst / "model.safetensors"), metadata={"format": "pt"}
    )
    for file in src.iterdir():
        if file.is_file() and not file.name.startswith("model") and file.name != "config.json":
            shutil.copy(file, dst / file.name)
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = quantization_config(fmt, group_size, desc_act)
    config["torch_dtype"] = "float16"
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    return dst


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("src")
    parser.add_argument("dst")
    parser.add_argument("--format", choices=("gptq", "awq"), default="gptq")
    parser.add_argument("--group-size", type=int, default=128)
    parser.add_argument("--desc-act", action="store_true")
    args = parser.parse_args(argv)
    print(write_quantized_folder(args.src, args.dst, args.format, args.group_size, args.desc_act))


if __name__ == "__main__":
    main()
