"""Tensor-parallel layout, process groups and collectives. With one rank every collective is a no-op.

`ParallelConfig` says which shard a process holds: the executor decides it and the model
builder hands it to every parallel layer (no process-wide state to set before building).
Two process groups: the default one (finite timeout, TESSERA_TP_TIMEOUT_S, default 300 s) for the
step's collectives, so a rank that hangs mid-step fails the step; and a gloo "control" group with
a very long timeout where idle ranks wait for the next step, possibly for hours.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

CONTROL_TIMEOUT = timedelta(days=365)


@dataclass(frozen=True)
class ParallelConfig:
    rank: int = 0
    size: int = 1


SINGLE = ParallelConfig()


def all_reduce(x: torch.Tensor, parallel: ParallelConfig) -> torch.Tensor:
    if parallel.size > 1:
        dist.all_reduce(x)
    return x


def all_gather_last_dim(x: torch.Tensor, parallel: ParallelConfig) -> torch.Tensor:
    """Concatenate every rank's shard along the last dimension (vocab-parallel logits)."""
    if parallel.size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(parallel.size)]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim=-1)


# ---- process groups ---------------------------------------------------------------------------------

_groups: dict = {}


def step_timeout() -> timedelta:
    return timedelta(seconds=float(os.environ.get("TESSERA_TP_TIMEOUT_S", "300")))


def init_groups(backend: str, init_method: str, rank: int, world_size: int) -> None:
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size, timeout=step_timeout())
    _groups["control"] = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)


def control_group():
    return _groups["control"]


def has_groups() -> bool:
    return bool(_groups)


def destroy_groups() -> None:
    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:
            pass
    _groups.clear()


def under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class TensorParallelError(RuntimeError):
    """A tensor-parallel rank died or failed; the engine cannot continue."""

    fatal = True  # the engine worker stops (and its supervisor restarts it) instead of carrying on
