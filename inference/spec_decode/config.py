"""`speculative_config` (vLLM's engine argument): which proposer, how many tokens, its knobs.

Given as a dict or a JSON string; every bad value is a start-up error that names its field.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, fields

METHODS = ("ngram", "draft_model")


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int | None = None  # ngram: shortest suffix matched
    prompt_lookup_max: int | None = None  # ngram: longest suffix matched (tried first)
    model: str | None = None  # draft_model: the draft's HF folder or GGUF file (the target's tokenizer)
    disable_by_batch_size: int | None = None  # no speculation while more requests than this run (vLLM's name)
    # draft_model: one proposed token's cost in plain target steps, which the choice of k weighs against
    # acceptance (default: measured as the engine runs, the draft's share of the target's weight bytes until
    # then; a value given here is used as it is: 0 speculates whenever accepted tokens alone pay)
    draft_cost: float | None = None

    @classmethod
    def parse(cls, value) -> SpeculativeConfig | None:
        """None / "" / {} mean off; a JSON string or a dict otherwise."""
        if value is None or value == "" or value == {}:
            return None
        if isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ValueError(f"speculative_config is not valid JSON: {exc}") from None
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a JSON object, got {value!r}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"speculative_config has unknown fields {unknown}; known: {sorted(known)}")
        for name in ("method", "num_speculative_tokens"):
            if name not in value:
                raise ValueError(f"speculative_config.{name} is required")
        config = cls(**value)
        config._validate()
        return config.with_lookup_defaults()

    def _validate(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative_config.method must be one of {', '.join(METHODS)}, got {self.method!r}")
        if not _is_int(self.num_speculative_tokens) or not 1 <= self.num_speculative_tokens <= 32:
            raise ValueError(
                "speculative_config.num_speculative_tokens must be an integer in [1, 32], "
                f"got {self.num_speculative_tokens!r}"
            )
        for name in ("prompt_lookup_min", "prompt_lookup_max"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or value < 1):
                raise ValueError(f"speculative_config.{name} must be an integer >= 1, got {value!r}")
        low, high = self.prompt_lookup_min, self.prompt_lookup_max
        if low is not None and high is not None and low > high:
            raise ValueError(f"speculative_config.prompt_lookup_min ({low}) must be <= prompt_lookup_max ({high})")
        if self.method == "draft_model" and not (isinstance(self.model, str) and self.model):
            raise ValueError("speculative_config.model (the draft model's path) is required for method draft_model")
        if self.method == "ngram" and self.model is not None:
            raise ValueError("speculative_config.model is only for method draft_model")
        size = self.disable_by_batch_size
        if size is not None and (not _is_int(size) or size < 1):
            raise ValueError(f"speculative_config.disable_by_batch_size must be an integer >= 1, got {size!r}")
        cost = self.draft_cost
        if cost is not None and (self.method != "draft_model" or not _is_number(cost) or not 0 <= cost < 1e6):
            raise ValueError(
                f"speculative_config.draft_cost must be a number >= 0 for method draft_model, got {cost!r}"
            )

    def with_lookup_defaults(self) -> SpeculativeConfig:
        """vLLM's rule: both n-gram bounds unset -> 5; one set -> the other takes its value."""
        if self.method != "ngram":
            return self
        low, high = self.prompt_lookup_min, self.prompt_lookup_max
        if low is None and high is None:
            low = high = 5
        low, high = (high if low is None else low), (low if high is None else high)
        return dataclasses.replace(self, prompt_lookup_min=low, prompt_lookup_max=high)


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
