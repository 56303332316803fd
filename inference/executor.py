"""Executors run each step's forward on every tensor-parallel rank; the engine talks to one interface.

UniprocExecutor: tensor_parallel_size 1, the engine's own ModelRunner and nothing else.
MultiprocExecutor (inference/multiproc_executor.py): tensor_parallel_size N, the engine process
as rank 0 of a torch.distributed group.
"""

from __future__ import annotations

from typing import Protocol

import torch

from inference.distributed import SINGLE, ParallelConfig
from inference.multiproc_executor import MultiprocExecutor


class Executor(Protocol):
    parallel: ParallelConfig  # the shard this process's model holds

    def bind(self, runner) -> None:
        """Take the engine's ModelRunner once the KV pool is sized."""

    def execute(self, inputs):
        """One forward on every rank: (hidden states, logits of the sampling rows)."""

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy-on-write block copies on every rank, before the step's forward."""

    def logits_of(self, hidden_rows: torch.Tensor) -> torch.Tensor:
        """Full-vocabulary logits of hidden rows (prompt logprobs)."""

    def activation_peak_bytes(self, engine) -> int:
        """The forward's activation peak on CUDA, for sizing the KV pool."""

    def shutdown(self) -> None:
        """Stop the other ranks; idempotent."""


def create_executor(args, device: torch.device) -> Executor:
    """The executor for args.tensor_parallel_size; its `parallel` tells the model which shard to build."""
    size = int(args.tensor_parallel_size)
    if size < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1, got {size}")
    if size == 1:
        return UniprocExecutor()
    return MultiprocExecutor(args, device)


class UniprocExecutor:
    parallel = SINGLE

    def bind(self, runner) -> None:
        self.runner = runner

    def execute(self, inputs):
        return self.runner.execute(inputs)

    def copy_blocks(self, copies) -> None:
        self.runner.copy_blocks(copies)

    def logits_of(self, hidden_rows):
        return self.runner.logits_of(hidden_rows)

    def activation_peak_bytes(self, engine) -> int:
        from inference.profiling import activation_peak_bytes

        return activation_peak_bytes(engine)

    def shutdown(self) -> None:
        pass
