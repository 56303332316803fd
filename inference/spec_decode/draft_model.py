"""Draft-model proposals: a second, smaller model with the target's tokenizer, run by the same engine.

The draft has its own paged KV cache (its own KVCacheManager and ModelRunner, no prefix caching)
and a DraftSequence per target sequence: the tokens whose K/V it holds. Each step it catches up
on what the target accepted since (one ragged forward for every speculating sequence), then runs
k - 1 batched decode steps, proposing its argmax each time (one-hot drafts, as vLLM's draft
proposers; rejection_sampler.py verifies them). Rolling back after a rejection is implicit: the
next step keeps only the longest prefix it shares with the target's tokens and frees the blocks
past it.

A draft forward that raises is retried one sequence at a time, so only the sequences whose own
forward fails lose their proposals (their requests fail with the draft model named); the rest
speculate as usual.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import cast

import torch

from inference.config import ModelConfig
from inference.engine_setup import weight_bytes
from inference.kv_cache_manager import KVCacheManager
from inference.loader import check_model_path, load_model
from inference.model_runner import ModelRunner
from inference.request import Request
from inference.sampler import first_max_index
from inference.scheduler import SchedulerOutput
from inference.spec_decode.config import SpeculativeConfig

logger = logging.getLogger("inference")


class DraftSequence:
    """What the draft model holds of one target sequence: the tokens, and how many have K/V."""

    prompt_logprobs = None  # read by ModelRunner.prepare

    def __init__(self):
        self.token_ids: list[int] = []
        self.num_computed_tokens = 0

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return 0


class DraftModelProposer:
    def __init__(self, config: SpeculativeConfig, engine):
        args = engine.args
        assert config.model is not None  # SpeculativeConfig requires it for draft_model
        check_model_path(config.model, args.load_format)
        draft_config = ModelConfig.from_path(config.model)
        target_vocab = engine.model_config.vocab_size
        if draft_config.vocab_size != target_vocab:
            raise ValueError(
                f"speculative_config.model {config.model}: vocab_size {draft_config.vocab_size} differs "
                f"from the target's {target_vocab} (a draft model needs the target's tokenizer)"
            )
        if draft_config.max_position_embeddings < engine.max_model_len:
            raise ValueError(
                f"speculative_config.model {config.model}: {draft_config.max_position_embeddings} "
                f"positions, fewer than max_model_len {engine.max_model_len}"
            )
        draft_args = dataclasses.replace(args, model=config.model, quantization=None, tensor_parallel_size=1)
        self.model = load_model(
            draft_args, draft_config, engine.ops, engine.dtype, engine.device, engine.max_model_len, progress=False
        )
        num_blocks = engine.memory["num_kv_blocks"]  # as many as the target: the draft's are smaller
        self.kv = KVCacheManager(num_blocks, args.block_size, enable_prefix_caching=False)
        self.runner = ModelRunner(self.model, args.block_size, num_blocks, engine.dtype, engine.device)
        self.seqs: dict[Request, DraftSequence] = {}
        self.round_tokens = config.num_speculative_tokens + 1  # what a round's first forward catches up on
        self.cost_per_token = (
            config.draft_cost
            if config.draft_cost is not None
            else weight_bytes(self.model) / max(weight_bytes(engine.model), 1)
        )

    def propose(self, seqs: list[Request], ks: list[int]) -> list[list[int] | BaseException]:
        self._forget_finished()
        drafts: list[list[int] | BaseException] = [[] for _ in seqs]
        for seq in seqs:
            self._catch_up(seq)
        active = list(range(len(seqs)))
        while active:
            got = self._forward(seqs, active, drafts)
            for i, token in got.items():
                tokens = drafts[i]
                assert isinstance(tokens, list)  # rows that failed are not in got
                tokens.append(token)
                draft = self.seqs[seqs[i]]
                draft.num_computed_tokens = draft.num_tokens
                draft.token_ids.append(token)
            # not those out of blocks, failed or done
            active = [i for i in got if isinstance(row := drafts[i], list) and len(row) < ks[i]]
        return drafts

    def catch_up_tokens(self, seq: Request) -> int:
        draft = self.seqs.get(seq)
        computed = draft.num_computed_tokens if draft is not None else 0
        return max(0, seq.num_tokens - 1 - computed - self.round_tokens)

    def _catch_up(self, seq: Request) -> None:
        """Roll the draft's copy back to the prefix it shares with seq, then take seq's tokens."""
        draft = self.seqs.setdefault(seq, DraftSequence())
        kept = min(draft.num_computed_tokens, seq.num_tokens - 1)  # the newest token is always this step's input
        for i in range(kept):
            if draft.token_ids[i] != seq.token_ids[i]:
                kept = i
                break
        draft.num_computed_tokens = kept
        draft.token_ids = list(seq.token_ids)
        self.kv.trim(draft, kept)

    def _forward(self, seqs: list[Request], rows: list[int], drafts: list) -> dict[int, int]:
        """One draft forward over these rows' uncomputed tokens: {row: the draft's next token} for the
        rows the draft's pool had room for. When the batch raises, each row alone; a row that still
        raises gets its exception in drafts."""
        rows = [i for i in rows if self._allocate(self.seqs[seqs[i]])]
        if not rows:
            return {}
        try:
            return dict(zip(rows, self._run([self.seqs[seqs[i]] for i in rows])))
        except Exception as exc:
            if len(rows) == 1:
                return self._failed(seqs, rows[0], drafts, exc)
            logger.exception("the draft model's batched forward failed; running it sequence by sequence")
        out = {}
        for i in rows:
            try:
                (out[i],) = self._run([self.seqs[seqs[i]]])
            except Exception as exc:
                self._failed(seqs, i, drafts, exc)
        return out

    def _allocate(self, draft: DraftSequence) -> bool:
        return self.kv.allocate_slots(draft, draft.num_tokens - draft.num_computed_tokens)

    def _failed(self, seqs: list[Request], row: int, drafts: list, exc: Exception) -> dict:
        drafts[row] = RuntimeError(f"the draft model failed: {type(exc).__name__}: {exc}")
        self._drop(seqs[row])
        return {}

    @torch.inference_mode()
    def _run(self, drafts: list[DraftSequence]) -> list[int]:
        plan = SchedulerOutput()
        seqs = cast(list[Request], drafts)  # a DraftSequence has all of a Request the runner reads
        plan.scheduled = {seq: seq.num_tokens - seq.num_computed_tokens for seq in seqs}
        plan.block_tables = {seq: self.kv.block_ids(seq) for seq in seqs}
        inputs = self.runner.prepare(plan)
        _, logits = self.runner.execute(inputs)
        assert logits is not None  # every draft row samples
        by_draft = dict(zip(inputs.sampling_requests, first_max_index(logits).tolist()))  # decodes come first
        return [by_draft[seq] for seq in seqs]

    def _forget_finished(self) -> None:
        for seq in [s for s in self.seqs if s.is_finished]:
            self._drop(seq)

    def _drop(self, seq: Request) -> None:
        draft = self.seqs.pop(seq, None)
        if draft is not None:
            self.kv.free(draft)
