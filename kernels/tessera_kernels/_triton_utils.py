"""Shared plumbing for the Triton kernels.

Importing this module before any @triton.jit decoration decides how the kernels run: natively
on CUDA, or in Triton's interpreter (TRITON_INTERPRET=1) on a machine without a GPU, so the same
launchers work in CPU tests and in the engine's CPU fallback of the "triton" backend.

Every kernel module imports this module before triton: the interpreter has to be chosen before
triton.language itself is loaded (its own helpers such as tl.sum are decorated at import).
"""

from __future__ import annotations

import os
import sys
import warnings

import torch

if not torch.cuda.is_available() and "TRITON_INTERPRET" not in os.environ:
    if "triton.language" in sys.modules:
        warnings.warn(
            "triton was imported before kernels on a machine without CUDA; "
            "set TRITON_INTERPRET=1 before importing it to run the Triton kernels",
            stacklevel=2,
        )
    os.environ["TRITON_INTERPRET"] = "1"

import triton  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def next_pow2(n: int) -> int:
    return triton.next_power_of_2(max(int(n), 1))


def upcast_dot_inputs(dtype: torch.dtype) -> bool:
    """Whether attention kernels should feed tl.dot float32 instead of the cache dtype.

    The interpreter stores bfloat16 as raw uint16 and gets any arithmetic on it (tl.dot included)
    wrong, so there everything is computed in float32. Natively bf16/fp16 go to the tensor cores as
    they are; fp32 caches stay fp32 (with input_precision="ieee", i.e. no TF32 rounding).
    """
    return INTERPRET or dtype == torch.float32


def check_last_dim_contiguous(*tensors: torch.Tensor) -> None:
    for t in tensors:
        if t.stride(-1) != 1:
            raise ValueError(f"expected a tensor whose last dimension is contiguous, got strides {t.stride()}")


def num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 1
