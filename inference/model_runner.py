"""Owns the model and the K/V memory; turns a scheduler decision into one flattened forward."""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import torch

from inference.decode_graph import DecodeGraphs
from inference.layers.linear import step_decode_rows
from inference.layers.ops import AttentionMetadata
from inference.request import Request
from inference.scheduler import SchedulerOutput


@dataclass
class StepInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    sample_rows: list[int]  # hidden-state row of each request that samples this step (1 + k of a speculating one)
    sampling_requests: list[Request]
    prompt_rows: dict[Request, tuple[int, int, int]]  # request -> (first row, row count, first position)


class ModelRunner:
    def __init__(self, model, block_size: int, num_blocks: int, dtype, device, enforce_eager: bool = False):
        self.model, self.block_size, self.device = model, block_size, torch.device(device)
        capture = not enforce_eager and DecodeGraphs.available(model, device)
        self.decode_graphs = DecodeGraphs(model, num_blocks, device) if capture else None
        self.last_step_captured = False  # the last execute() captured a decode step: slower than it will run
        attn_layers = [layer.self_attn.attn for layer in model.layers]
        first = attn_layers[0]
        shape = (num_blocks, self.block_size, first.num_kv_heads, first.head_dim)
        self.k_caches = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in attn_layers]
        self.v_caches = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in attn_layers]
        for attn, k, v in zip(attn_layers, self.k_caches, self.v_caches):
            attn.k_cache, attn.v_cache = k, v

    @staticmethod
    def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype) -> int:
        return 2 * num_layers * block_size * num_kv_heads * head_dim * torch.empty(0, dtype=dtype).element_size()

    def prepare(self, plan: SchedulerOutput) -> StepInputs:
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_start, seq_lens, tables = [0], [], []
        sample_rows: list[int] = []
        sampling_requests, prompt_rows = [], {}
        bs = self.block_size
        # Decodes first: attention runs them as one batch and only the rest as ragged prefill. A
        # speculating decode (its last token and its k proposals) is 1 + k one-token decodes, each
        # attending to the positions up to its own: every row gets the arithmetic of a plain decode
        # step, so verification scores exactly what decoding without speculation would.
        order = sorted(plan.scheduled.items(), key=lambda item: item[1] != 1 and item[0] not in plan.spec_tokens)
        for request, num_new in order:
            start, end = request.num_computed_tokens, request.num_computed_tokens + num_new
            table = plan.block_tables[request]
            drafts = plan.spec_tokens.get(request, [])
            first_row = len(input_ids)
            input_ids.extend(request.token_ids[start:end] if not drafts else request.token_ids[start:] + drafts)
            positions.extend(range(start, end))
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            if request.prompt_logprobs is not None and start < request.num_prompt_tokens:
                prompt_rows[request] = (first_row, num_new, start)
            for seq_len in range(start + 1, end + 1) if drafts else (end,):
                query_start.append(first_row + seq_len - start)
                seq_lens.append(seq_len)
                tables.append(table)
            if end == request.num_tokens + len(drafts):
                sample_rows.extend(range(len(input_ids) - 1 - len(drafts), len(input_ids)))
                sampling_requests.append(request)
        num_decodes = sum(1 for first, last in zip(query_start, query_start[1:]) if last - first == 1)
        width = max(len(t) for t in tables)
        padded = [t + [0] * (width - len(t)) for t in tables]
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            query_start_loc=torch.tensor(query_start, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            block_tables=torch.tensor(padded, dtype=torch.int32, device=dev),
            num_decodes=num_decodes,
        )
        return StepInputs(
            input_ids=torch.tensor(input_ids, dtype=torch.int64, device=dev),
            positions=torch.tensor(positions, dtype=torch.int64, device=dev),
            meta=meta,
            sample_rows=sample_rows,
            sampling_requests=sampling_requests,
            prompt_rows=prompt_rows,
        )

    def warm_up_inputs(self, prompt_tokens: int, table: list[int]) -> list[StepInputs]:
        """A prefill of `prompt_tokens` tokens, then one decode after it, for one sequence in the blocks
        `table` (LLMEngine.warm_up gives empty ones: a request writes a block's K/V before it reads it,
        so what these steps leave there never shows)."""
        dev, bs = self.device, self.block_size
        steps = []
        for start, count, num_decodes in ((0, prompt_tokens, 0), (prompt_tokens, 1, 1)):
            positions = list(range(start, start + count))
            meta = AttentionMetadata(
                slot_mapping=torch.tensor(
                    [table[p // bs] * bs + p % bs for p in positions], dtype=torch.int64, device=dev
                ),
                query_start_loc=torch.tensor([0, count], dtype=torch.int32, device=dev),
                seq_lens=torch.tensor([start + count], dtype=torch.int32, device=dev),
                block_tables=torch.tensor([table], dtype=torch.int32, device=dev),
                num_decodes=num_decodes,
            )
            steps.append(
                StepInputs(
                    input_ids=torch.zeros(count, dtype=torch.int64, device=dev),
                    positions=torch.tensor(positions, dtype=torch.int64, device=dev),
                    meta=meta,
                    sample_rows=[count - 1],
                    sampling_requests=[],
                    prompt_rows={},
                )
            )
        return steps

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy-on-write: duplicate shared blocks before a sequence writes into its own copy."""
        if not copies:
            return
        src = torch.tensor([s for s, _ in copies], device=self.device)
        dst = torch.tensor([d for _, d in copies], device=self.device)
        for cache in self.k_caches + self.v_caches:
            cache[dst] = cache[src]

    @torch.inference_mode()
    def execute(self, inputs: StepInputs) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Run the forward; returns (hidden states of all tokens, logits of the sampling rows, if any).
        A decode-only step of a captured batch size is replayed (inference/decode_graph.py)."""
        self.last_step_captured = False
        if self.decode_graphs is not None and self.decode_graphs.eligible(inputs):
            replayed_hidden, replayed_logits, self.last_step_captured = self.decode_graphs.execute(inputs)
            return replayed_hidden, replayed_logits
        with step_decode_rows(inputs.meta.num_decodes):
            hidden = self.model(inputs.input_ids, inputs.positions, inputs.meta)
        if not inputs.sample_rows:
            return hidden, None
        rows = torch.tensor(inputs.sample_rows, dtype=torch.long, device=self.device)
        # the decodes' sampled rows come first among the logits' rows, as their rows do in the body
        with step_decode_rows(bisect.bisect_left(inputs.sample_rows, inputs.meta.num_decodes)):
            return hidden, self.model.compute_logits(hidden.index_select(0, rows))

    @torch.inference_mode()
    def logits_of(self, hidden_rows: torch.Tensor) -> torch.Tensor:
        return self.model.compute_logits(hidden_rows)
