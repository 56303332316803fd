"""What rank 0 broadcasts to the other tensor-parallel ranks: a command header, then one flat tensor.

The header is HEADER int64 slots (command, then its sizes) on the control group; the payload
follows on the default group. A step's inputs travel as one int64 tensor cut apart by its sizes.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from inference.layers.ops import AttentionMetadata
from inference.model_runner import StepInputs

CMD_EXECUTE, CMD_COPY, CMD_LOGITS, CMD_STOP = 1, 2, 3, 4
HEADER = 8  # int64 slots: command + its sizes


def header(command: int, sizes: Sequence[int] = ()) -> torch.Tensor:
    out = torch.zeros(HEADER, dtype=torch.int64)
    out[0] = command
    out[1 : 1 + len(sizes)] = torch.tensor(list(sizes), dtype=torch.int64)
    return out


def pack_step(inputs: StepInputs) -> tuple[torch.Tensor, list[int]]:
    """StepInputs -> (one int64 tensor, the sizes needed to cut it apart again)."""
    meta = inputs.meta
    rows = torch.tensor(inputs.sample_rows, dtype=torch.int64, device=inputs.input_ids.device)
    parts = [
        inputs.input_ids,
        inputs.positions,
        meta.slot_mapping,
        meta.query_start_loc,
        meta.seq_lens,
        meta.block_tables.flatten(),
        rows,
    ]
    payload = torch.cat([p.to(torch.int64) for p in parts])
    num_seqs, width = meta.block_tables.shape
    return payload, [inputs.input_ids.shape[0], num_seqs, width, len(inputs.sample_rows), meta.num_decodes]


def step_lengths(sizes: list[int]) -> list[int]:
    tokens, seqs, width, samples = sizes[:4]
    return [tokens, tokens, tokens, seqs + 1, seqs, seqs * width, samples]


def unpack_step(payload: torch.Tensor, sizes: list[int]) -> StepInputs:
    tokens, seqs, width, samples, num_decodes = sizes
    ids, pos, slots, qsl, seq_lens, tables, rows = payload.split(step_lengths(sizes))
    meta = AttentionMetadata(
        slot_mapping=slots,
        query_start_loc=qsl.to(torch.int32),
        seq_lens=seq_lens.to(torch.int32),
        block_tables=tables.to(torch.int32).reshape(seqs, width),
        num_decodes=num_decodes,
    )
    return StepInputs(
        input_ids=ids, positions=pos, meta=meta, sample_rows=rows.tolist(), sampling_requests=[], prompt_rows={}
    )
