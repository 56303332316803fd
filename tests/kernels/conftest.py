"""Kernel tests run natively on CUDA, or in Triton's interpreter on a machine without a GPU.

The interpreter must be chosen before triton is first imported (triton.language decorates its
own helpers at import), hence here, at collection time, rather than in the test modules.
"""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
