"""Speculative decoding: proposers behind one interface (n-gram prompt lookup, a draft model), the
policy that picks k per step (speculator.py) and the verification (rejection_sampler.py)."""

from __future__ import annotations

from inference.spec_decode.config import SpeculativeConfig
from inference.spec_decode.speculator import Proposer, Speculator


def create_speculator(config: SpeculativeConfig | None, engine) -> Speculator | None:
    """The engine's speculator for its speculative_config (None: plain decoding)."""
    if config is None:
        return None
    proposer: Proposer
    if config.method == "ngram":
        from inference.spec_decode.ngram import NgramProposer

        low, high = config.prompt_lookup_min, config.prompt_lookup_max
        assert low is not None and high is not None  # with_lookup_defaults sets both for ngram
        proposer = NgramProposer(low, high)
    else:
        from inference.spec_decode.draft_model import DraftModelProposer

        proposer = DraftModelProposer(config, engine)
    from inference.quantization.gguf import row_invariant_rows

    row_limit = row_invariant_rows(engine.model)
    return Speculator(config, proposer, engine.sampler, engine.metrics, engine.max_model_len, row_limit)


__all__ = ["SpeculativeConfig", "Speculator", "create_speculator"]
