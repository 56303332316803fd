"""Prompt-lookup proposals (vLLM's `ngram` method): no model, only the sequence's own tokens.

The last n tokens (n from prompt_lookup_max down to prompt_lookup_min) are looked for earlier in
prompt + output; at the most recent earlier occurrence, the up to k tokens that followed it are
the proposal. Summaries, answers from a passage and code edits copy long runs of their input,
which is where this pays.
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from inference.request import Request


class NgramProposer:
    cost_per_token = 0.0  # a lookup in lists the engine holds anyway

    def __init__(self, prompt_lookup_min: int, prompt_lookup_max: int):
        self.min_n, self.max_n = prompt_lookup_min, prompt_lookup_max

    def propose(self, seqs: list[Request], ks: list[int]) -> list[list[int]]:
        return [ngram_proposal(seq.token_ids, k, self.min_n, self.max_n) if k else [] for seq, k in zip(seqs, ks)]

    def catch_up_tokens(self, seq: Request) -> int:
        return 0


def ngram_proposal(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """Up to k tokens that followed the latest earlier match of the longest matching suffix."""
    length = len(tokens)
    if length < min_n + 1:
        return []
    ids = np.asarray(tokens, dtype=np.int64)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        # windows that start at 0 .. length - n - 1: each has a following token, and none is the suffix itself
        windows = sliding_window_view(ids[: length - 1], n)
        hits = np.flatnonzero((windows == ids[length - n :]).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return tokens[start : start + k]
    return []
