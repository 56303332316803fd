"""Tensor-parallel ranks 1..N-1: join the group, load this rank's shard, run what rank 0 broadcasts.

A spawned rank starts in `worker_main`; a rank on another machine is started by torchrun
(inference/tp_rank.py). Either way `serve` receives rank 0's engine arguments, loads the shard,
reports its load status, allocates the same KV pool and loops until CMD_STOP.
"""

from __future__ import annotations

import os
import threading
import time
import traceback
from typing import Any

import torch
import torch.distributed as dist

from inference.config import EngineArgs, ModelConfig
from inference.distributed import ParallelConfig, TensorParallelError, control_group, destroy_groups, init_groups
from inference.engine_setup import choose_ops, keep_freed_memory, resolve_device, resolve_max_model_len
from inference.loader import load_model
from inference.model_runner import ModelRunner
from inference.step_wire import CMD_COPY, CMD_EXECUTE, CMD_LOGITS, CMD_STOP, HEADER, step_lengths, unpack_step


def worker_main(rank: int, world_size: int, init_method: str, backend: str, joining=None) -> None:
    """Entry point of a spawned rank: join the group, load this rank's shard, execute until told to stop."""
    watch_parent()
    if backend == "gloo":
        torch.set_num_threads(max(1, torch.get_num_threads() // world_size))
    else:
        torch.cuda.set_device(rank % torch.cuda.device_count())
    if joining is not None:
        joining.send("joining")
        joining.close()
    init_groups(backend, init_method, rank, world_size)
    try:
        serve(ParallelConfig(rank, world_size))
    finally:
        destroy_groups()


def serve(parallel: ParallelConfig) -> None:
    received: list[Any] = [None]
    dist.broadcast_object_list(received, src=0, group=control_group())
    args = EngineArgs(**received[0])
    runner, status = None, "ok"
    try:
        runner = WorkerRunner(args, parallel)
    except Exception:
        status = traceback.format_exc()
    statuses = [None] * parallel.size
    dist.all_gather_object(statuses, status, group=control_group())
    if any(s != "ok" for s in statuses):
        return
    assert runner is not None  # every rank, this one included, said ok
    num_blocks = torch.zeros(1, dtype=torch.int64)
    dist.broadcast(num_blocks, src=0, group=control_group())
    runner.allocate(int(num_blocks))
    keep_freed_memory(runner.device)
    runner.loop()


class WorkerRunner:
    """A rank's model shard and KV pool; runs whatever rank 0 broadcasts."""

    def __init__(self, args, parallel: ParallelConfig):
        device = resolve_device(args.device)
        if device.type == "cuda":  # the launcher chose this rank's GPU (set_device)
            device = torch.device("cuda", torch.cuda.current_device())
        torch.manual_seed(args.seed)
        cfg = ModelConfig.from_path(args.model)
        self.args, self.device, self.dtype = args, device, cfg.resolve_dtype(args.dtype)
        self.model = load_model(
            args,
            cfg,
            choose_ops(args, device),
            self.dtype,
            device,
            resolve_max_model_len(cfg, args.max_model_len),
            progress=False,
            parallel=parallel,
        )

    def allocate(self, num_blocks: int) -> None:
        self.runner = ModelRunner(
            self.model, self.args.block_size, num_blocks, self.dtype, self.device, self.args.enforce_eager
        )

    def loop(self) -> None:
        header = torch.zeros(HEADER, dtype=torch.int64)
        while True:
            dist.broadcast(header, src=0, group=control_group())
            command, sizes = int(header[0]), header[1:].tolist()
            if command == CMD_STOP:
                return
            self.handle(command, sizes)

    def handle(self, command: int, sizes: list[int]) -> None:
        if command == CMD_EXECUTE:
            payload = self._receive(sum(step_lengths(sizes)), torch.int64)
            self.runner.execute(unpack_step(payload, sizes[:5]))
        elif command == CMD_COPY:
            flat = self._receive(2 * sizes[0], torch.int64).tolist()
            self.runner.copy_blocks(list(zip(flat[0::2], flat[1::2])))
        elif command == CMD_LOGITS:
            rows = self._receive(sizes[0] * sizes[1], self.dtype).reshape(sizes[0], sizes[1])
            self.runner.logits_of(rows)
        else:
            raise TensorParallelError(f"unknown command {command} from rank 0")

    def _receive(self, numel: int, dtype) -> torch.Tensor:
        buf = torch.empty(numel, dtype=dtype, device=self.device)
        dist.broadcast(buf, src=0)
        return buf


def watch_parent() -> None:
    """Exit when the process that started this rank is gone (no orphaned ranks)."""
    parent = os.getppid()

    def watch():
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, name="tp-parent-watch", daemon=True).start()
