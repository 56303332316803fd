"""Vocab-parallel token embedding and LM head (each rank holds a contiguous slice of the vocab)."""

from __future__ import annotations

import torch
from torch import nn

from inference.distributed import SINGLE, ParallelConfig, all_gather_last_dim, all_reduce
from inference.layers import onednn
from inference.layers.linear import STEP_DECODE_ROWS, copy_checked, with_loader
from tessera_kernels import quant_cpu


def packed_kind(loaded) -> str | None:
    """The ggml type of a checkpoint tensor kept as GGUF blocks (a PackedTensor), else None."""
    return None if isinstance(loaded, torch.Tensor) else loaded.kind


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden: int, dtype, parallel: ParallelConfig = SINGLE):
        super().__init__()
        self.vocab_size, self.parallel = vocab_size, parallel
        self.shard = -(-vocab_size // parallel.size)
        self.start = parallel.rank * self.shard
        self.end = min(self.start + self.shard, vocab_size)
        self.hidden, self.dtype = hidden, dtype
        # empty, not zeros: a packed GGUF table replaces it, and zeros would write the whole float table
        # (2 GiB for a 128k x 4096 vocabulary) only to drop it
        self.weight = with_loader(
            nn.Parameter(torch.empty(self.shard, hidden, dtype=dtype), requires_grad=False), self.weight_loader
        )

    def weight_loader(self, param, loaded, shard_id=None):
        if packed_kind(loaded) is not None:
            self.keep_packed(param, loaded)
            return
        rows = loaded[self.start : self.end]
        copy_checked(param.data[: rows.shape[0]], rows)
        param.data[rows.shape[0] :].zero_()  # the last shard's padding past the vocabulary

    def keep_packed(self, param, loaded) -> None:
        """A GGUF table kept as its blocks: the parameter holds the bytes and says their type."""
        if self.parallel.size > 1 or loaded.shape != (self.vocab_size, self.hidden):
            raise ValueError(
                f"packed GGUF table of shape {tuple(loaded.shape)} does not fit "
                f"{self.vocab_size} x {self.hidden} on one rank"
            )
        param.data = loaded.data
        param.ggml_type = loaded.kind

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        kind = getattr(self.weight, "ggml_type", None)
        if kind is not None:  # only the rows asked for are dequantized
            return quant_cpu.dequantize_rows(self.weight, kind, input_ids, self.hidden, self.dtype)
        if self.parallel.size == 1:
            return nn.functional.embedding(input_ids, self.weight)
        outside = (input_ids < self.start) | (input_ids >= self.end)
        local = (input_ids - self.start).masked_fill(outside, 0)
        out = nn.functional.embedding(local, self.weight).masked_fill(outside[:, None], 0)
        return all_reduce(out, self.parallel)


class ParallelLMHead(VocabParallelEmbedding):
    """Logits = hidden @ weight.T per vocab shard, gathered across ranks.

    On CPU the logits GEMM reads a oneDNN-packed copy of the weight (layers/onednn.py); the dense
    weight stays, because tied embeddings look tokens up in it. A GGUF table kept as its blocks
    (weights="packed") is multiplied as it is, by kernels/tessera_kernels/quant_cpu.py.
    """

    packed = None

    def process_weights_after_loading(self) -> None:
        self.packed = onednn.pack(self.weight.data) if onednn.can_pack(self.weight) else None

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        kind = getattr(self.weight, "ggml_type", None)
        if kind is not None:
            return quant_cpu.linear(hidden, self.weight, kind, self.hidden, decode_rows=STEP_DECODE_ROWS.get())
        local = nn.functional.linear(hidden, self.weight) if self.packed is None else onednn.linear(hidden, self.packed)
        return all_gather_last_dim(local, self.parallel)[..., : self.vocab_size]
