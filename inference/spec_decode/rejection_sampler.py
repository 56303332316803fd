"""Verification: which proposed tokens a sequence keeps, so its outputs are what the target gives alone.

The target scored the sequence's last token and its k proposals in one forward: row j holds its
logits after the last token and proposals 0..j-1. Row j goes through the processing a plain step
would give that position once proposals 0..j-1 were appended (min_tokens, penalties, logit_bias,
allowed_token_ids, bad_words, the grammar's mask, temperature, top-k/top-p/min-p: a DraftedRow);
then, row by row:

- greedy: the target's argmax; a proposal is kept while it equals that argmax;
- sampled: the token a plain step would draw from that row (its probabilities over the row's own
  exponential noise, argmax(p / q) with q ~ Exp(1) from the request's generator); a proposal is
  kept while it equals that token.

Either way the first token that differs from its proposal (or the row after the last proposal,
the bonus token) is emitted and the rest is rejected. Proposals here are single tokens (n-gram
matches, a draft model's argmax), that is drafts with a one-hot distribution q, and for those
this is the rejection rule of Leviathan et al. / Chen et al.: proposal x is kept with probability
p(x) = min(1, p(x) / q(x)), and when it is not, the token emitted is distributed as
norm(max(0, p - q)), p without x. So the output distribution is exactly the target's; and because
the noise of each emitted token is the noise that position would get without speculation (the
generator is advanced once per emitted token), a seeded request gives the same tokens with
speculation on or off, whatever else is in the batch and whatever k was.
"""

from __future__ import annotations

import torch

from inference.request import Request
from inference.sampler import SampledRow, Sampler, first_max_index
from inference.structured_output import MatcherAfter


class RejectionSampler:
    def __init__(self, sampler: Sampler):
        self.sampler = sampler

    @torch.inference_mode()
    def __call__(self, logits: torch.Tensor, seq: Request, drafts: list[int]) -> tuple[list[int], list]:
        """logits [len(drafts) + 1, vocab] -> (the emitted tokens, 1 to len(drafts) + 1; their logprob entries)."""
        rows: list[SampledRow] = [seq, *(DraftedRow(seq, drafts[:j]) for j in range(1, len(drafts) + 1))]
        processed, raw_logprobs = self.sampler.process(logits, rows)
        if seq.params.greedy:
            targets = first_max_index(processed).tolist()
            tokens = targets[: num_accepted(targets, drafts) + 1]
        else:
            probs = self.sampler.probabilities(processed, [seq.params] * len(rows))
            tokens = []
            for row, draft in enumerate([*drafts, None]):
                tokens.append(self.sampler.draw(probs[row], seq.generator))
                if tokens[-1] != draft:
                    break
        return tokens, self.sampler.logprob_entries(raw_logprobs, tokens, rows[: len(tokens)])


class DraftedRow:
    """A sequence as a plain step would see it once `drafts` were appended: what the sampler's per-row
    processing reads (the output so far, the grammar's state) for one verification row."""

    def __init__(self, seq: Request, drafts: list[int]):
        self.seq, self.drafts = seq, drafts
        self.params, self.generator = seq.params, seq.generator
        self.matcher = None if seq.matcher is None else MatcherAfter(seq.matcher, drafts)

    @property
    def token_ids(self) -> list[int]:
        return self.seq.token_ids + self.drafts

    @property
    def output_token_ids(self) -> list[int]:
        return self.seq.output_token_ids + self.drafts

    @property
    def num_output_tokens(self) -> int:
        return self.seq.num_output_tokens + len(self.drafts)


def num_accepted(targets: list[int], drafts: list[int]) -> int:
    """How many leading proposals equal the target's tokens."""
    count = 0
    for target, draft in zip(targets, drafts):
        if target != draft:
            break
        count += 1
    return count
