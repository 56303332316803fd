"""Tensor-parallel state. One process per rank; with a single rank every collective is a no-op."""
from __future__ import annotations

import torch
import torch.distributed as dist

_state = {"rank": 0, "size": 1}


def set_tensor_parallel(rank: int, size: int) -> None:
    _state.update(rank=rank, size=size)


def tp_rank() -> int:
    return _state["rank"]


def tp_size() -> int:
    return _state["size"]


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    if tp_size() > 1:
        dist.all_reduce(x)
    return x


def all_gather_last_dim(x: torch.Tensor) -> torch.Tensor:
    """Concatenate every rank's shard along the last dimension (vocab-parallel logits)."""
    if tp_size() == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(tp_size())]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim=-1)
