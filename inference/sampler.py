"""One batched sampling pass per step; every row keeps its own parameters and seeded generator.

Order (as in vLLM): raw logprobs -> min_tokens masking -> penalties -> logit_bias, allowed_token_ids
and bad_words -> grammar masks (structured outputs: the tokens each row's matcher allows) -> greedy argmax, or
temperature -> top-k / top-p / min-p -> sample. Sampling draws q ~ Exp(1) per row with that
row's generator and takes argmax(p / q), which is an exact sample from p and reproducible per
request whatever else is in the batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

import torch

from inference.outputs import Logprob
from inference.request import Request
from inference.sampling_params import SamplingParams

if TYPE_CHECKING:
    from inference.structured_output import TokenMasker


class SampledRow(Protocol):
    """What a row's processing reads: a Request, or one verification row of it (spec_decode's DraftedRow)."""

    params: SamplingParams
    generator: torch.Generator | None
    matcher: Any

    @property
    def token_ids(self) -> list[int]: ...

    @property
    def output_token_ids(self) -> list[int]: ...

    @property
    def num_output_tokens(self) -> int: ...


class Sampler:
    def __init__(self, vocab_size: int, eos_token_ids: list[int]):
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self._masker: TokenMasker | None = None  # made for the first row with a grammar

    @torch.inference_mode()
    def __call__(self, logits: torch.Tensor, seqs: list[Request]) -> tuple[list[int], list[dict[int, Logprob] | None]]:
        logits, raw_logprobs = self.process(logits, seqs)
        tokens = self._pick(logits, seqs)
        token_list = tokens.tolist()
        return token_list, self.logprob_entries(raw_logprobs, token_list, seqs)

    def process(self, logits: torch.Tensor, seqs: Sequence[SampledRow]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Every row's logits after masks and penalties, and the raw logprobs (if a row asks): all but the pick."""
        # min_tokens masking and penalties write in place: into a private copy, never the caller's
        # logits (a row-by-row retry after a failure must see them unchanged); else no copy at all.
        writes = any(
            s.params.uses_penalties
            or s.params.restricts_tokens
            or s.num_output_tokens < s.params.min_tokens
            or s.matcher is not None
            for s in seqs
        )
        # Greedy rows with nothing to write read bfloat16 logits as they are: widening changes no value,
        # and the [256, 49152] float32 copy cost more than the pick itself.
        if writes or any(not s.params.greedy or s.params.logprobs is not None for s in seqs):
            logits = logits.to(torch.float32, copy=writes)
        raw_logprobs = self._raw_logprobs(logits, seqs)
        self._mask_min_tokens(logits, seqs)
        self._apply_penalties(logits, seqs)
        self._restrict_tokens(logits, seqs)
        self._mask_grammars(logits, seqs)
        self._check_some_token_is_allowed(logits, seqs)
        return logits, raw_logprobs

    def _raw_logprobs(self, logits, seqs):
        if all(s.params.logprobs is None for s in seqs):
            return None
        return torch.log_softmax(logits, dim=-1)

    def _mask_min_tokens(self, logits, seqs):
        for row, seq in enumerate(seqs):
            # a grammar decides where its structure may end (banning EOS there would ban every token)
            if seq.num_output_tokens < seq.params.min_tokens and seq.matcher is None:
                banned = seq.params.stop_token_ids + ([] if seq.params.ignore_eos else self.eos_token_ids)
                # an id beyond the vocabulary can never be sampled anyway; indexing it would fail the whole batch
                banned = [t for t in banned if t < logits.shape[1]]
                if banned:
                    logits[row, banned] = float("-inf")

    def _apply_penalties(self, logits, seqs):
        for row, seq in enumerate(seqs):
            params = seq.params
            if not params.uses_penalties:
                continue
            if params.repetition_penalty != 1.0:
                seen = torch.tensor(seq.token_ids, dtype=torch.long, device=logits.device).unique()
                values = logits[row, seen]
                logits[row, seen] = torch.where(
                    values > 0, values / params.repetition_penalty, values * params.repetition_penalty
                )
            if params.presence_penalty or params.frequency_penalty:
                outputs = torch.tensor(seq.output_token_ids, dtype=torch.long, device=logits.device)
                counts = torch.bincount(outputs, minlength=logits.shape[1]).to(logits.dtype)
                logits[row] -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0).to(
                    logits.dtype
                )

    def _restrict_tokens(self, logits, seqs):
        for row, seq in enumerate(seqs):
            params = seq.params
            if not params.restricts_tokens:
                continue
            if params.logit_bias:
                ids = torch.tensor(list(params.logit_bias), dtype=torch.long, device=logits.device)
                logits[row, ids] += torch.tensor(
                    list(params.logit_bias.values()), dtype=logits.dtype, device=logits.device
                )
            if params.allowed_token_ids is not None:
                allowed = torch.tensor(params.allowed_token_ids, dtype=torch.long, device=logits.device)
                kept = logits[row, allowed]
                logits[row] = float("-inf")
                logits[row, allowed] = kept
            banned = banned_bad_word_tokens(params.bad_words_token_ids, seq.output_token_ids)
            if banned:
                logits[row, banned] = float("-inf")

    def _mask_grammars(self, logits, seqs):
        matchers = [s.matcher for s in seqs]
        if all(m is None for m in matchers):
            return
        if self._masker is None:
            from inference.structured_output import TokenMasker

            self._masker = TokenMasker(logits.shape[1])
        self._masker.apply(logits, matchers)

    @staticmethod
    def _check_some_token_is_allowed(logits, seqs):
        """Masks that together ban every token (allowed_token_ids that are all stop tokens under
        min_tokens, say) would make argmax return token 0: fail loudly instead (the engine then
        samples row by row, so only that request fails)."""
        rows = [i for i, s in enumerate(seqs) if s.params.restricts_tokens or s.matcher is not None]
        if rows and torch.isneginf(logits[rows]).all(dim=-1).any():
            raise ValueError(
                "no token satisfies the request's constraints (allowed_token_ids, bad_words, "
                "min_tokens, structured_outputs) at this position"
            )

    def _pick(self, logits, seqs) -> torch.Tensor:
        greedy = first_max_index(logits)
        random_rows = [i for i, s in enumerate(seqs) if not s.params.greedy]
        if not random_rows:
            return greedy
        rows = torch.tensor(random_rows, device=logits.device)
        probs = self.probabilities(logits[rows], [seqs[i].params for i in random_rows])
        noise = torch.empty_like(probs)
        for j, i in enumerate(random_rows):
            self._draw_noise(noise[j], seqs[i].generator)
        greedy[rows] = first_max_index(probs / noise)
        return greedy

    def probabilities(self, logits: torch.Tensor, params) -> torch.Tensor:
        """Sampling rows' probabilities after temperature, top-k, top-p and min-p (not renormalised)."""
        temps = torch.tensor([p.temperature for p in params], device=logits.device, dtype=logits.dtype)
        return self._filter(torch.softmax(logits / temps[:, None], dim=-1), params)

    def draw(self, probs: torch.Tensor, generator: torch.Generator | None) -> int:
        """One token of one row of probabilities(), drawn exactly as a batched step draws it for that row."""
        noise = torch.empty_like(probs)
        self._draw_noise(noise, generator)
        return int(first_max_index(probs / noise))

    @staticmethod
    def _draw_noise(row: torch.Tensor, generator: torch.Generator | None) -> None:
        if generator is None or generator.device == row.device:
            row.exponential_(generator=generator)
        else:  # seeded generators live on the CPU: draw there, so a seed gives the same tokens on any device
            row.copy_(torch.empty(row.shape, dtype=row.dtype).exponential_(generator=generator))

    def _filter(self, probs, params) -> torch.Tensor:
        """top-k, then top-p (nucleus), then min-p; the kept mass is renormalised implicitly."""
        if any(p.top_k > 0 for p in params):
            ks = torch.tensor([p.top_k if p.top_k > 0 else probs.shape[1] for p in params], device=probs.device)
            sorted_probs = probs.sort(dim=-1, descending=True).values
            kth = sorted_probs.gather(1, (ks.clamp(max=probs.shape[1]) - 1)[:, None])
            probs = probs.masked_fill(probs < kth, 0.0)
        if any(p.top_p < 1.0 for p in params):
            top_p = torch.tensor([p.top_p for p in params], device=probs.device, dtype=probs.dtype)
            sorted_probs, order = probs.sort(dim=-1, descending=True)
            mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
            drop_sorted = mass_before > top_p[:, None] * sorted_probs.sum(dim=-1, keepdim=True)
            probs = probs.masked_fill(drop_sorted.scatter(1, order, drop_sorted), 0.0)
        if any(p.min_p > 0 for p in params):
            min_p = torch.tensor([p.min_p for p in params], device=probs.device, dtype=probs.dtype)
            threshold = min_p[:, None] * probs.max(dim=-1, keepdim=True).values
            probs = probs.masked_fill(probs < threshold, 0.0)
        return probs

    def logprob_entries(self, raw_logprobs, tokens, seqs):
        entries: list[dict[int, Logprob] | None] = [None] * len(seqs)
        if raw_logprobs is None:
            return entries
        for row, seq in enumerate(seqs):
            k = seq.params.logprobs
            if k is None:
                continue
            entries[row] = top_logprobs(raw_logprobs[row], tokens[row], k)
        return entries


def banned_bad_word_tokens(sequences: list[list[int]], output: list[int]) -> list[int]:
    """The last token of every bad word whose other tokens the output has just produced (vLLM's rule)."""
    banned = []
    for ids in sequences:
        prefix = ids[:-1]
        if len(output) >= len(prefix) and output[len(output) - len(prefix) :] == prefix:
            banned.append(ids[-1])
    return banned


def top_logprobs(row_logprobs: torch.Tensor, chosen: int, k: int) -> dict[int, Logprob]:
    """The chosen token's logprob and rank plus the k most likely tokens."""
    chosen_lp = row_logprobs[chosen]
    entry = {chosen: Logprob(float(chosen_lp), int((row_logprobs > chosen_lp).sum()) + 1)}
    if k > 0:
        values, ids = row_logprobs.topk(min(k, row_logprobs.shape[-1]))
        for rank, (tid, lp) in enumerate(zip(ids.tolist(), values.tolist()), start=1):
            entry.setdefault(tid, Logprob(lp, rank))
    return entry


def first_max_index(x: torch.Tensor) -> torch.Tensor:
    """argmax over the last dim (the first of tied maxima, as argmax): torch's max(dim) reduction is
    faster than argmax's on CPU (docs/kernels.md, Measurements behind code comments)."""
    return x.max(dim=-1).indices
