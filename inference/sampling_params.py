"""Sampling parameters, named and validated as in vLLM and the OpenAI API."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

from inference.structured_output import KINDS, StructuredOutputs

# Fields a request may leave to the model: its generation_config.json (or GGUF metadata) decides,
# and these fallbacks (vLLM's) apply when the model says nothing.
GREEDY_BELOW_TEMPERATURE = 1e-5
MODEL_DEFAULTS = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0}


@dataclass
class SamplingParams:
    """How to pick tokens and when to stop. Invalid values raise ValueError naming the field.

    n > 1 forks one prompt into n sequences after prefill; sequence i samples with seed + i
    (when a seed is given), so it reproduces an n=1 request with that seed.

    temperature, top_p, top_k, min_p and repetition_penalty left out (or None) mean "the model's
    default": they hold vLLM's fallbacks until the engine applies the model's own defaults
    (with_model_defaults, at add_request); `model_default_fields` names them.
    """

    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float | None = None
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # vLLM's structured outputs: one of json (a schema), json_object, regex, choice, grammar (EBNF)
    structured_outputs: StructuredOutputs | dict | None = None
    # OpenAI's logit_bias ({token id: bias in [-100, 100]}, added to the logits before sampling),
    # vLLM's allowed_token_ids (every other token is masked) and bad_words (never completed)
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    # False: never speculate for this request (speculative decoding's opt-out; outputs are the same either way)
    speculative: bool = True
    # bad_words as token sequences (each word with and without a leading space), set by
    # bind_tokenizer when the engine accepts the request; the sampler bans their last tokens
    bad_words_token_ids: list[list[int]] = field(default_factory=list, repr=False)
    stop_strings: list[str] = field(init=False, repr=False)
    model_default_fields: frozenset[str] = field(init=False, repr=False)

    def __post_init__(self):
        self.model_default_fields = frozenset(name for name in MODEL_DEFAULTS if getattr(self, name) is None)
        for name in self.model_default_fields:
            setattr(self, name, MODEL_DEFAULTS[name])
        self.stop_strings = [self.stop] if isinstance(self.stop, str) else _as_list(self.stop, "stop")
        self.stop_token_ids = _as_list(self.stop_token_ids, "stop_token_ids")
        if self.top_k == 0:
            self.top_k = -1
        self.structured_outputs = _as_structured_outputs(self.structured_outputs)
        self.logit_bias = _as_logit_bias(self.logit_bias)
        self.bad_words = _as_list(self.bad_words, "bad_words")
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = _as_list(self.allowed_token_ids, "allowed_token_ids")
        self._validate()

    def _validate(self):
        p: Any = self  # the fields as given, of any type, until these checks pass
        checks = [
            ("n", lambda: isinstance(p.n, int) and p.n >= 1, "must be an integer >= 1"),
            ("temperature", lambda: p.temperature >= 0, "must be >= 0"),
            ("top_p", lambda: 0 < p.top_p <= 1, "must be in (0, 1]"),
            (
                "top_k",
                lambda: isinstance(p.top_k, int) and (p.top_k == -1 or p.top_k >= 1),
                "must be -1, 0 (off) or >= 1",
            ),
            ("min_p", lambda: 0 <= p.min_p <= 1, "must be in [0, 1]"),
            (
                "max_tokens",
                lambda: p.max_tokens is None or (isinstance(p.max_tokens, int) and p.max_tokens >= 1),
                "must be an integer >= 1",
            ),
            ("min_tokens", lambda: isinstance(p.min_tokens, int) and p.min_tokens >= 0, "must be an integer >= 0"),
            ("min_tokens", lambda: p.max_tokens is None or p.min_tokens <= p.max_tokens, "must be <= max_tokens"),
            ("presence_penalty", lambda: -2 <= p.presence_penalty <= 2, "must be in [-2, 2]"),
            ("frequency_penalty", lambda: -2 <= p.frequency_penalty <= 2, "must be in [-2, 2]"),
            ("repetition_penalty", lambda: p.repetition_penalty > 0, "must be > 0"),
            (
                "logprobs",
                lambda: p.logprobs is None or (isinstance(p.logprobs, int) and 0 <= p.logprobs <= 20),
                "must be an integer in [0, 20]",
            ),
            (
                "prompt_logprobs",
                lambda: (
                    p.prompt_logprobs is None or (isinstance(p.prompt_logprobs, int) and 0 <= p.prompt_logprobs <= 20)
                ),
                "must be an integer in [0, 20]",
            ),
            (
                "stop",
                lambda: all(isinstance(s, str) and s for s in p.stop_strings),
                "must be a non-empty string or a list of them",
            ),
            (
                "stop_token_ids",
                lambda: all(isinstance(t, int) and t >= 0 for t in p.stop_token_ids),
                "must be a list of token ids",
            ),
            (
                "logit_bias",
                lambda: all(-100 <= b <= 100 for b in p.logit_bias.values()),
                "biases must be in [-100, 100]",
            ),
            (
                "allowed_token_ids",
                lambda: (
                    p.allowed_token_ids is None
                    or (p.allowed_token_ids and all(_is_token_id(t) for t in p.allowed_token_ids))
                ),
                "must be a non-empty list of token ids",
            ),
            (
                "bad_words",
                lambda: all(isinstance(w, str) and w.strip() for w in p.bad_words),
                "must be a list of non-empty strings",
            ),
            ("speculative", lambda: isinstance(p.speculative, bool), "must be true or false"),
            (
                "seed",
                lambda: p.seed is None or (isinstance(p.seed, int) and -(2**63) <= p.seed < 2**64),
                "must be an integer in [-2**63, 2**64) (what torch.Generator takes)",
            ),
            # both say which tokens may come next; their intersection is usually empty
            (
                "allowed_token_ids",
                lambda: p.allowed_token_ids is None or p.structured_outputs is None,
                "cannot be combined with structured_outputs (the grammar decides which tokens may come)",
            ),
        ]
        for name, check, why in checks:
            try:
                ok = check()
            except TypeError:  # a value of the wrong type is invalid too, and must name its field
                ok = False
            if not ok:
                raise ValueError(f"SamplingParams.{name} {why}, got {getattr(self, name)!r}")

    @property
    def restricts_tokens(self) -> bool:
        """logit_bias, allowed_token_ids or bad_words: the sampler edits this row's logits."""
        return bool(self.logit_bias) or self.allowed_token_ids is not None or bool(self.bad_words_token_ids)

    def bind_tokenizer(self, tokenizer, vocab_size: int) -> "SamplingParams":
        """Check token ids against the vocabulary and tokenize bad_words (the engine calls this once)."""
        for name, ids in (("logit_bias", self.logit_bias or {}), ("allowed_token_ids", self.allowed_token_ids or [])):
            out_of_range = [t for t in ids if t >= vocab_size]
            if out_of_range:
                raise ValueError(
                    f"SamplingParams.{name} has token ids outside the vocabulary [0, {vocab_size}): {out_of_range[:5]}"
                )
        if not self.bad_words or self.bad_words_token_ids:
            return self
        bound = copy.copy(self)
        bound.bad_words_token_ids = bad_words_token_ids(tokenizer, self.bad_words)
        return bound

    @property
    def greedy(self) -> bool:
        # vLLM's epsilon: dividing logits by a temperature of 1e-100 overflows them to +-inf (NaN probs)
        assert self.temperature is not None  # __post_init__ puts the model's default in
        return self.temperature < GREEDY_BELOW_TEMPERATURE

    @property
    def uses_penalties(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1.0

    def with_model_defaults(self, defaults: dict) -> "SamplingParams":
        """A copy whose unset fields take the model's defaults (a bad model value names its field)."""
        chosen = {name: defaults[name] for name in self.model_default_fields if defaults.get(name) is not None}
        if not chosen:
            return self
        resolved = copy.copy(self)
        for name, value in chosen.items():
            setattr(resolved, name, value)
        if resolved.top_k == 0:
            resolved.top_k = -1
        resolved._validate()
        return resolved

    def for_child(self, index: int) -> "SamplingParams":
        """Parameters of the index-th of n forked sequences: n=1 and seed + index."""
        from dataclasses import replace

        seed = None if self.seed is None else self.seed + index
        if seed is not None and seed >= 2**64:  # wrap as torch.Generator does (2**64 + k seeds like k)
            seed -= 2**64
        return replace(self, n=1, seed=seed)


def _as_structured_outputs(value) -> StructuredOutputs | None:
    """A dict (how the protocol carries it) becomes StructuredOutputs; a bad one names the field."""
    if value is None or isinstance(value, StructuredOutputs):
        return value
    if not isinstance(value, dict):
        raise ValueError(f"SamplingParams.structured_outputs must be an object, got {value!r}")
    try:
        return StructuredOutputs(**value)
    except TypeError:
        raise ValueError(
            f"SamplingParams.structured_outputs takes only {', '.join(KINDS)}; got {sorted(value)}"
        ) from None
    except ValueError as exc:
        raise ValueError(f"SamplingParams.{exc}") from None


def bad_words_token_ids(tokenizer, words: list[str]) -> list[list[int]]:
    """Each word's token sequences, as vLLM makes them: the word alone and after a space (mid-text)."""
    sequences = []
    for word in words:
        for variant in (word.lstrip(), " " + word.lstrip()):
            ids = list(tokenizer.encode(variant, add_special_tokens=False))
            if ids and ids not in sequences:
                sequences.append(ids)
    return sequences


def _is_token_id(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _as_logit_bias(value) -> dict[int, float]:
    """{token id: bias}; JSON's string keys ("50256") become ints. A bad entry names the field."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ValueError(f"SamplingParams.logit_bias must be an object of token id -> bias, got {value!r}")
    bias = {}
    for key, amount in value.items():
        token = int(key) if isinstance(key, str) and key.isascii() and key.isdigit() and len(key) <= 12 else key
        if not _is_token_id(token) or isinstance(amount, bool) or not isinstance(amount, (int, float)):
            raise ValueError(f"SamplingParams.logit_bias must map token ids to numbers, got {key!r}: {amount!r}")
        bias[token] = float(amount)
    return bias


def _as_list(value, name: str) -> list:
    if value is None:
        return []
    if not isinstance(value, (list, tuple)):
        raise ValueError(f"SamplingParams.{name} must be a list, got {value!r}")
    return list(value)
