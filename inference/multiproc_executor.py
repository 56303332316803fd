"""Rank 0 of a tensor-parallel group: the engine process, which also runs its own shard.

MultiprocExecutor: tensor_parallel_size N on torch.distributed (gloo on CPU, NCCL on CUDA). The
engine process is rank 0: it schedules, holds its 1/N of the weights and KV pool, and before each
collective step broadcasts the step's inputs (a small header, then one flat int64 tensor); ranks
1..N-1 only execute. Every rank runs the same forward, so the model's all-reduces and the LM
head's all-gather line up; rank 0 alone samples from the gathered logits.

Two process groups: the header goes over a gloo "control" group with a very long timeout (idle
ranks wait there between steps, possibly for hours), everything else over the default group with
a finite timeout (TESSERA_TP_TIMEOUT_S, default 300 s), so a rank that hangs mid-step fails the
step instead of hanging it. A rank that dies is noticed at once: rank 0 checks its children before
each step and turns any collective failure into a TensorParallelError naming the dead rank; the
other ranks exit when their connection to rank 0 breaks or their parent process disappears.

On one machine the engine spawns the ranks itself (torch.multiprocessing, "spawn"). Across
machines every rank is started by torchrun (see docs/parallelism_and_quantization.md): rank 0 is
the engine (`python manage.py engine`), the others run `python -m inference.tp_rank`; rank 0
sends them its engine arguments, so they need no flags of their own.

The other ranks' loop is inference/tp_worker.py; what goes over the wire, inference/step_wire.py.
"""

from __future__ import annotations

import atexit
import logging
import multiprocessing.connection
import os
import time
from typing import Any

import torch
import torch.distributed as dist

from inference.distributed import (
    ParallelConfig,
    TensorParallelError,
    control_group,
    destroy_groups,
    free_port,
    has_groups,
    init_groups,
    step_timeout,
    under_torchrun,
)
from inference.step_wire import CMD_COPY, CMD_EXECUTE, CMD_LOGITS, CMD_STOP, header, pack_step
from inference.tp_worker import worker_main

logger = logging.getLogger("inference")


class MultiprocExecutor:
    """Rank 0 of a tensor-parallel group (see the module docstring)."""

    def __init__(self, args, device: torch.device):
        self.world_size = int(args.tensor_parallel_size)
        self.parallel = ParallelConfig(0, self.world_size)
        self.device = device
        self.procs: list = []
        self.runner: Any = None  # rank 0's model runner, from bind()
        self._closed = False
        self._serving = False  # the other ranks are in their step loop (and can take a stop message)
        self._threads = torch.get_num_threads()
        atexit.register(self.shutdown)
        try:
            self._start(args)
        except BaseException:
            self.shutdown()
            raise

    # ---- start-up ---------------------------------------------------------------------------

    def _start(self, args) -> None:
        backend = "nccl" if self.device.type == "cuda" else "gloo"
        if under_torchrun():
            if int(os.environ["RANK"]) != 0 or int(os.environ["WORLD_SIZE"]) != self.world_size:
                raise TensorParallelError(
                    f"under torchrun the engine must be rank 0 of WORLD_SIZE={self.world_size}; got "
                    f"RANK={os.environ['RANK']} WORLD_SIZE={os.environ['WORLD_SIZE']} (other ranks run "
                    "`python -m inference.tp_rank`)"
                )
            init_method = "env://"
        else:
            init_method = f"tcp://127.0.0.1:{free_port()}"
            self._spawn_workers(init_method, backend)
        if self.device.type == "cpu":  # N ranks share the cores
            torch.set_num_threads(max(1, self._threads // self.world_size))
        self._guard(lambda: init_groups(backend, init_method, 0, self.world_size))
        self._guard(lambda: dist.broadcast_object_list([args.to_dict()], src=0, group=control_group()))

    def _spawn_workers(self, init_method: str, backend: str) -> None:
        ctx = torch.multiprocessing.get_context("spawn")
        readers = []
        for rank in range(1, self.world_size):
            reader, writer = ctx.Pipe(duplex=False)
            proc = ctx.Process(
                target=worker_main,
                args=(rank, self.world_size, init_method, backend, writer),
                name=f"tessera-tp-rank{rank}",
                daemon=True,
            )
            proc.start()
            writer.close()
            self.procs.append(proc)
            readers.append(reader)
        self._wait_until_joining(readers)

    def _wait_until_joining(self, readers) -> None:
        """Each rank says when it is about to join the group; one that dies first fails the start now
        (rank 0 would otherwise wait out the group's timeout for a rank that never connects)."""
        timeout = step_timeout().total_seconds()
        for rank, (reader, proc) in enumerate(zip(readers, self.procs), start=1):
            try:
                if reader not in multiprocessing.connection.wait([reader, proc.sentinel], timeout=timeout):
                    raise EOFError
                reader.recv()  # EOFError when the rank died without a word
            except EOFError:
                proc.join(timeout=1)
                state = (
                    f"exited with code {proc.exitcode}"
                    if proc.exitcode is not None
                    else f"did not start in {timeout:.0f} s"
                )
                raise TensorParallelError(
                    f"tensor-parallel rank {rank} (pid {proc.pid}) {state} before joining the group"
                )
            finally:
                reader.close()

    def bind(self, runner) -> None:
        """After the KV pool is sized: every rank reports its load, then allocates the same pool."""
        self.runner = runner
        num_blocks = runner.k_caches[0].shape[0]
        statuses = [None] * self.world_size
        self._guard(lambda: dist.all_gather_object(statuses, "ok", group=control_group()))
        failed = [(rank, s) for rank, s in enumerate(statuses) if s != "ok"]
        if failed:
            rank, message = failed[0]
            raise TensorParallelError(f"tensor-parallel rank {rank} failed to load the model:\n{message}")
        self._guard(lambda: dist.broadcast(torch.tensor([num_blocks]), src=0, group=control_group()))
        self._serving = True

    # ---- steps ------------------------------------------------------------------------------

    def execute(self, inputs):
        payload, sizes = pack_step(inputs)
        self._send(CMD_EXECUTE, sizes, payload)
        return self._guard(lambda: self.runner.execute(inputs))

    def copy_blocks(self, copies) -> None:
        if not copies:
            return
        flat = torch.tensor([i for pair in copies for i in pair], dtype=torch.int64, device=self.device)
        self._send(CMD_COPY, [len(copies)], flat)
        self.runner.copy_blocks(copies)

    def logits_of(self, hidden_rows):
        rows = hidden_rows.contiguous()
        self._send(CMD_LOGITS, list(rows.shape), rows)
        return self._guard(lambda: self.runner.logits_of(rows))

    def activation_peak_bytes(self, engine) -> int:
        raise TensorParallelError(
            "CUDA memory profiling with tensor_parallel_size > 1 is not supported; give num_kv_blocks explicitly"
        )

    def _send(self, command: int, sizes: list[int], payload: torch.Tensor) -> None:
        self.check_alive()
        self._guard(lambda: dist.broadcast(header(command, sizes), src=0, group=control_group()))
        self._guard(lambda: dist.broadcast(payload, src=0))

    # ---- failures and shutdown --------------------------------------------------------------

    def check_alive(self) -> None:
        if self._closed:
            raise TensorParallelError("the tensor-parallel group has been shut down")
        dead = [(rank, p) for rank, p in enumerate(self.procs, start=1) if not p.is_alive()]
        if dead:
            rank, proc = dead[0]
            self.shutdown()
            raise TensorParallelError(
                f"tensor-parallel rank {rank} (pid {proc.pid}) died with exit code {proc.exitcode}; "
                "the engine stopped the whole group and cannot continue"
            )

    def _guard(self, fn):
        """Run a collective; a failure becomes a TensorParallelError naming a dead rank if one died."""
        try:
            return fn()
        except TensorParallelError:
            raise
        except Exception as exc:
            self._serving = False  # the group is broken: no stop message, just stop the processes
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline and all(p.is_alive() for p in self.procs):
                time.sleep(0.05)  # give a dying rank a moment to be reaped, for a precise message
            self.check_alive()
            self.shutdown()
            raise TensorParallelError(
                f"tensor-parallel collective failed ({exc}); the engine stopped the whole group"
            ) from exc

    def shutdown(self) -> None:
        """Stop every rank (a clean stop message first, then terminate, then kill); idempotent."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.shutdown)
        if self._serving and has_groups() and all(p.is_alive() for p in self.procs):
            try:
                dist.broadcast(header(CMD_STOP), src=0, group=control_group())
            except Exception:  # a broken group: the processes are stopped below anyway
                self._serving = False
        for proc in self.procs:
            proc.join(timeout=10 if self._serving else 0)
        for proc in self.procs:
            if proc.is_alive():
                proc.terminate()
                proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
                proc.join()
        destroy_groups()
        torch.set_num_threads(self._threads)
