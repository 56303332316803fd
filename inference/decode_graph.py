"""Captured decode steps on CPU: a decode-only batch's C kernel calls, recorded once and replayed.

At batch 1 a decode step is a few hundred small kernel calls, about ten a layer, and the model's
Python between them (module calls, views, argument checks) costs about as much as the kernels.
For each decode-only batch size the first step runs eagerly while tessera_kernels.native_cpu records
every kernel call with its arguments. A later step of that size writes its inputs (token ids,
positions, slots, sequence lengths, block tables) into the tensors the recording read them from, then
makes the same calls again: the same kernels on the same memory, so the same bits as the model gives.
This is the CPU's counterpart of vLLM's CUDA graphs, and `enforce_eager` turns it off as it does there.

A step can only be replayed if everything it computed was a recorded kernel call. The capture watches
torch's dispatcher: it keeps every tensor the step makes alive (the recorded pointers point into them)
and gives up for good when anything else computed (a dense GEMM through oneDNN, a torch fallback, a
collective).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from inference.layers.ops import AttentionMetadata

MAX_BATCH = 8  # well below quant_cpu.DEQUANTIZE_FROM_ROWS, where the packed linears compute through torch
MIN_TABLE_WIDTH = 64  # blocks; a wider table is captured again at twice the width
# What a captured step may do in torch besides the recorded calls: make tensors and views of them.
ALLOCATIONS_AND_VIEWS = {
    "empty",
    "empty_like",
    "new_empty",
    "empty_strided",
    "view",
    "_unsafe_view",
    "reshape",
    "split",
    "split_with_sizes",
    "slice",
    "select",
    "as_strided",
    "t",
    "transpose",
    "alias",
    "unsqueeze",
    "squeeze",
    "detach",
    "expand",
    "permute",
}
SAME_TENSOR_UNLESS_COPIED = {"to", "contiguous"}  # fine when they hand back their input


class WatchComputations(TorchDispatchMode):
    """Keeps every tensor made under it alive and notes each operator that computed something."""

    def __init__(self):
        super().__init__()
        self.kept: list = []
        self.computed: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        returned_input = name in SAME_TENSOR_UNLESS_COPIED and args and out is args[0]
        if name not in ALLOCATIONS_AND_VIEWS and not returned_input:
            self.computed.append(str(func))
        self.kept.append(out)
        return out


class DecodeGraph:
    """One batch size's static inputs, the tensors its capture made, and the calls to make again."""

    def __init__(self, batch: int, width: int, device):
        def zeros(*shape, dtype):
            return torch.zeros(*shape, dtype=dtype, device=device)

        self.input_ids = zeros(batch, dtype=torch.int64)
        self.positions = zeros(batch, dtype=torch.int64)
        self.meta = AttentionMetadata(
            slot_mapping=zeros(batch, dtype=torch.int64),
            query_start_loc=torch.arange(batch + 1, dtype=torch.int32, device=device),
            seq_lens=zeros(batch, dtype=torch.int32),
            block_tables=zeros(batch, width, dtype=torch.int32),
            num_decodes=batch,
        )
        self.calls: list[tuple[Callable[..., Any], tuple, Any]] = []
        self.kept: list = []
        self.hidden = self.logits = torch.empty(0)

    @property
    def width(self) -> int:
        return self.meta.block_tables.shape[1]

    def load(self, inputs) -> None:
        meta = inputs.meta
        self.input_ids.copy_(inputs.input_ids)
        self.positions.copy_(inputs.positions)
        self.meta.slot_mapping.copy_(meta.slot_mapping)
        self.meta.seq_lens.copy_(meta.seq_lens)
        self.meta.block_tables[:, : meta.block_tables.shape[1]].copy_(meta.block_tables)

    def capture(self, model) -> list[str]:
        """Runs the step eagerly, recording it; returns what computed outside the recorded calls
        (nothing when the step can be replayed)."""
        from tessera_kernels import native_cpu

        with native_cpu.recording() as recorder, WatchComputations() as watch:
            self.hidden = model(self.input_ids, self.positions, self.meta)
            self.logits = model.compute_logits(self.hidden)
        self.calls, self.kept = recorder.calls, watch.kept
        return watch.computed

    def replay(self) -> None:
        """The recorded calls again; each must return what it did then (its success status)."""
        for function, args, returned in self.calls:
            if function(*args) != returned:
                raise RuntimeError(f"a kernel failed in a replayed decode step: {function.__name__}")


class DecodeGraphs:
    """The captured batch sizes of one model runner, and those that cannot be captured."""

    def __init__(self, model, num_blocks: int, device):
        self.model, self.num_blocks, self.device = model, num_blocks, torch.device(device)
        self.graphs: dict[int, DecodeGraph] = {}
        # batch size -> what computed outside the kernels; one refusal ends capturing: what made it (a dense
        # GEMM, a fallback) is the model's, and a capture step is slow (speculation leaves it untimed)
        self.refused: dict[int, list[str]] = {}
        self.replays = 0

    @staticmethod
    def available(model, device) -> bool:
        """On CPU with the C kernels, one rank: a collective is never left out of a replay."""
        from tessera_kernels import native_cpu

        one_rank = getattr(getattr(model, "parallel", None), "size", 1) == 1
        return torch.device(device).type == "cpu" and one_rank and native_cpu.load() is not None

    def eligible(self, inputs) -> bool:
        batch = inputs.meta.num_seqs
        return (
            inputs.meta.decode_only
            and batch <= MAX_BATCH
            and not self.refused
            and not inputs.prompt_rows
            and inputs.sample_rows == list(range(batch))
        )

    def execute(self, inputs) -> tuple[torch.Tensor, torch.Tensor, bool]:
        """(hidden, logits, captured) of an eligible step: replayed, or captured on its batch size's first
        step (captured: True)."""
        batch, width = inputs.meta.num_seqs, inputs.meta.block_tables.shape[1]
        graph = self.graphs.get(batch)
        if graph is None or graph.width < width:
            graph = DecodeGraph(batch, self.table_width(width), self.device)
            graph.load(inputs)
            computed = graph.capture(self.model)
            if computed:
                self.refused[batch] = computed
            else:
                self.graphs[batch] = graph
            return graph.hidden.clone(), graph.logits.clone(), True
        graph.load(inputs)
        graph.replay()
        self.replays += 1
        return graph.hidden.clone(), graph.logits.clone(), False

    def table_width(self, needed: int) -> int:
        width = MIN_TABLE_WIDTH
        while width < needed:
            width *= 2
        return min(width, max(needed, self.num_blocks))
