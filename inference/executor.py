"""Executors run each step's forward on every tensor-parallel rank; the engine talks to one interface.

UniprocExecutor: tensor_parallel_size 1, the engine's own ModelRunner and nothing else.

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
"""
from __future__ import annotations

import atexit
import logging
import multiprocessing.connection
import os
import socket
import threading
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist

from inference.distributed import set_tensor_parallel
from inference.layers.ops import AttentionMetadata

logger = logging.getLogger("inference")

CMD_EXECUTE, CMD_COPY, CMD_LOGITS, CMD_STOP = 1, 2, 3, 4
HEADER = 8  # int64 slots: command + its sizes
CONTROL_TIMEOUT = timedelta(days=365)  # idle ranks wait for the next step without limit


class TensorParallelError(RuntimeError):
    """A tensor-parallel rank died or failed; the engine cannot continue."""

    fatal = True  # the engine worker stops (and its supervisor restarts it) instead of carrying on


def step_timeout() -> timedelta:
    return timedelta(seconds=float(os.environ.get("TESSERA_TP_TIMEOUT_S", "300")))


def create_executor(args, device: torch.device):
    """The executor for args.tensor_parallel_size; call before building the model (sets the TP rank)."""
    size = int(args.tensor_parallel_size)
    if size < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1, got {size}")
    if size == 1:
        set_tensor_parallel(0, 1)
        return UniprocExecutor()
    return MultiprocExecutor(args, device)


class UniprocExecutor:
    world_size = 1

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


class MultiprocExecutor:
    """Rank 0 of a tensor-parallel group (see the module docstring)."""

    def __init__(self, args, device: torch.device):
        self.world_size = int(args.tensor_parallel_size)
        self.device = device
        self.procs: list = []
        self.runner = None
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
                    "`python -m inference.tp_rank`)")
            init_method = "env://"
        else:
            init_method = f"tcp://127.0.0.1:{free_port()}"
            self._spawn_workers(init_method, backend)
        if self.device.type == "cpu":  # N ranks share the cores
            torch.set_num_threads(max(1, self._threads // self.world_size))
        self._guard(lambda: init_groups(backend, init_method, 0, self.world_size))
        set_tensor_parallel(0, self.world_size)
        self._guard(lambda: dist.broadcast_object_list([args.to_dict()], src=0, group=self.control))

    def _spawn_workers(self, init_method: str, backend: str) -> None:
        ctx = torch.multiprocessing.get_context("spawn")
        readers = []
        for rank in range(1, self.world_size):
            reader, writer = ctx.Pipe(duplex=False)
            proc = ctx.Process(target=worker_main, args=(rank, self.world_size, init_method, backend, writer),
                               name=f"tessera-tp-rank{rank}", daemon=True)
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
                state = (f"exited with code {proc.exitcode}" if proc.exitcode is not None
                         else f"did not start in {timeout:.0f} s")
                raise TensorParallelError(
                    f"tensor-parallel rank {rank} (pid {proc.pid}) {state} before joining the group")
            finally:
                reader.close()

    @property
    def control(self):
        return _groups["control"]

    def bind(self, runner) -> None:
        """After the KV pool is sized: every rank reports its load, then allocates the same pool."""
        self.runner = runner
        num_blocks = runner.k_caches[0].shape[0]
        statuses = [None] * self.world_size
        self._guard(lambda: dist.all_gather_object(statuses, "ok", group=self.control))
        failed = [(rank, s) for rank, s in enumerate(statuses) if s != "ok"]
        if failed:
            rank, message = failed[0]
            raise TensorParallelError(f"tensor-parallel rank {rank} failed to load the model:\n{message}")
        self._guard(lambda: dist.broadcast(torch.tensor([num_blocks]), src=0, group=self.control))
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
        raise TensorParallelError("CUDA memory profiling with tensor_parallel_size > 1 is not supported; "
                                  "give num_kv_blocks explicitly")

    def _send(self, command: int, sizes: list[int], payload: torch.Tensor) -> None:
        self.check_alive()
        header = torch.zeros(HEADER, dtype=torch.int64)
        header[0] = command
        header[1:1 + len(sizes)] = torch.tensor(sizes, dtype=torch.int64)
        self._guard(lambda: dist.broadcast(header, src=0, group=self.control))
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
                "the engine stopped the whole group and cannot continue")

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
            raise TensorParallelError(f"tensor-parallel collective failed ({exc}); "
                                      "the engine stopped the whole group") from exc

    def shutdown(self) -> None:
        """Stop every rank (a clean stop message first, then terminate, then kill); idempotent."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.shutdown)
        if self._serving and _groups and all(p.is_alive() for p in self.procs):
            try:
                stop = torch.zeros(HEADER, dtype=torch.int64)
                stop[0] = CMD_STOP
                dist.broadcast(stop, src=0, group=_groups["control"])
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
        set_tensor_parallel(0, 1)
        torch.set_num_threads(self._threads)


# ---- the group -----------------------------------------------------------------------------------

_groups: dict = {}


def init_groups(backend: str, init_method: str, rank: int, world_size: int) -> None:
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size,
                            timeout=step_timeout())
    _groups["control"] = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)


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


# ---- step inputs on the wire -----------------------------------------------------------------------

def pack_step(inputs) -> tuple[torch.Tensor, list[int]]:
    """StepInputs -> (one int64 tensor, the sizes needed to cut it apart again)."""
    meta = inputs.meta
    rows = torch.tensor(inputs.sample_rows, dtype=torch.int64, device=inputs.input_ids.device)
    parts = [inputs.input_ids, inputs.positions, meta.slot_mapping, meta.query_start_loc, meta.seq_lens,
             meta.block_tables.flatten(), rows]
    payload = torch.cat([p.to(torch.int64) for p in parts])
    num_seqs, width = meta.block_tables.shape
    return payload, [inputs.input_ids.shape[0], num_seqs, width, len(inputs.sample_rows), meta.num_decodes]


def unpack_step(payload: torch.Tensor, sizes: list[int]):
    from inference.model_runner import StepInputs

    tokens, seqs, width, samples, num_decodes = sizes
    cuts = [tokens, tokens, tokens, seqs + 1, seqs, seqs * width, samples]
    ids, pos, slots, qsl, seq_lens, tables, rows = payload.split(cuts)
    meta = AttentionMetadata(slot_mapping=slots, query_start_loc=qsl.to(torch.int32),
                             seq_lens=seq_lens.to(torch.int32),
                             block_tables=tables.to(torch.int32).reshape(seqs, width), num_decodes=num_decodes)
    return StepInputs(input_ids=ids, positions=pos, meta=meta, sample_rows=rows.tolist(),
                      sampling_requests=[], prompt_rows={})


# ---- ranks 1..N-1 ---------------------------------------------------------------------------------

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
    set_tensor_parallel(rank, world_size)
    try:
        serve(rank)
    finally:
        destroy_groups()


def serve(rank: int) -> None:
    from inference.config import EngineArgs

    received = [None]
    dist.broadcast_object_list(received, src=0, group=_groups["control"])
    args = EngineArgs(**received[0])
    runner, status = None, "ok"
    try:
        runner = WorkerRunner(args, rank)
    except Exception:
        status = traceback.format_exc()
    statuses = [None] * dist.get_world_size()
    dist.all_gather_object(statuses, status, group=_groups["control"])
    if any(s != "ok" for s in statuses):
        return
    num_blocks = torch.zeros(1, dtype=torch.int64)
    dist.broadcast(num_blocks, src=0, group=_groups["control"])
    runner.allocate(int(num_blocks))
    runner.loop()


class WorkerRunner:
    """A rank's model shard and KV pool; runs whatever rank 0 broadcasts."""

    def __init__(self, args, rank: int):
        from inference.config import ModelConfig
        from inference.engine import resolve_device, resolve_max_model_len
        from inference.layers.ops import get_ops
        from inference.loader import load_model

        device = resolve_device(args.device)
        if device.type == "cuda":  # the launcher chose this rank's GPU (set_device)
            device = torch.device("cuda", torch.cuda.current_device())
        torch.manual_seed(args.seed)
        cfg = ModelConfig.from_path(args.model)
        self.args, self.device, self.dtype = args, device, cfg.resolve_dtype(args.dtype)
        ops = get_ops(args.attention_backend or ("triton" if device.type == "cuda" else "torch"))
        self.model = load_model(args, cfg, ops, self.dtype, device, resolve_max_model_len(cfg, args.max_model_len),
                                progress=False)

    def allocate(self, num_blocks: int) -> None:
        from inference.model_runner import ModelRunner

        self.runner = ModelRunner(self.model, self.args.block_size, num_blocks, self.dtype, self.device)

    def loop(self) -> None:
        header = torch.zeros(HEADER, dtype=torch.int64)
        while True:
            dist.broadcast(header, src=0, group=_groups["control"])
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


def step_lengths(sizes: list[int]) -> list[int]:
    tokens, seqs, width, samples = sizes[:4]
    return [tokens, tokens, tokens, seqs + 1, seqs, seqs * width, samples]


def watch_parent() -> None:
    """Exit when the process that started this rank is gone (no orphaned ranks)."""
    parent = os.getppid()

    def watch():
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, name="tp-parent-watch", daemon=True).start()


def main() -> None:
    """A rank other than 0 of a multi-machine group, started by torchrun (inference/tp_rank.py)."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s rank%(process)d %(message)s")
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if rank == 0:
        raise SystemExit("rank 0 is the engine (python manage.py engine --arg tensor_parallel_size=N); "
                         "run this module on the other ranks")
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    local = int(os.environ.get("LOCAL_RANK", rank))
    if backend == "nccl":
        torch.cuda.set_device(local % torch.cuda.device_count())
    init_groups(backend, "env://", rank, world_size)
    set_tensor_parallel(rank, world_size)
    try:
        serve(rank)
    finally:
        destroy_groups()
