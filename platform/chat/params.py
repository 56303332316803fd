"""Validation of the playground's sampling parameters (the parameters panel) and where they start.

The panel starts from the served model's own defaults (its generation_config.json or GGUF
metadata) and, for what the model leaves open, from the playground's: a 135M chat model such as
SmolLM2 loops at temperature 0.7 without a repetition penalty, so the playground starts cooler
and with a mild penalty (see docs/running.md for the measurement).
"""

from __future__ import annotations

from functools import lru_cache

PLAYGROUND_DEFAULTS = {
    "temperature": 0.2,
    "top_p": 0.9,
    "top_k": 0,
    "repetition_penalty": 1.1,
    "max_tokens": 256,
    "seed": None,
    "stop": [],
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
}
MODEL_FIELDS = ("temperature", "top_p", "top_k", "repetition_penalty")  # what a model's defaults may set
RANGES = {
    "temperature": (0.0, 2.0),
    "top_p": (0.01, 1.0),
    "repetition_penalty": (0.5, 2.0),
    "presence_penalty": (-2.0, 2.0),
    "frequency_penalty": (-2.0, 2.0),
}
MAX_STOP_SEQUENCES = 4


class InvalidParams(ValueError):
    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field


@lru_cache(maxsize=4)
def _model_defaults(model: str) -> dict:
    from inference.gguf_files import generation_defaults

    try:
        found = generation_defaults(model)
    except (OSError, ValueError):  # a missing or broken model is reported where it is loaded
        return {}
    return {name: found[name] for name in MODEL_FIELDS if name in found}


def model_defaults() -> dict:
    """The served model's own values for the panel's fields (only those it sets)."""
    from django.conf import settings

    return _model_defaults(str(settings.MODEL))


def defaults() -> dict:
    """The panel's starting values: the model's where it has them, the playground's otherwise."""
    return {**PLAYGROUND_DEFAULTS, **model_defaults()}


def default_sources() -> dict:
    """For each model-settable field: "model" or "playground" (shown next to the field)."""
    found = model_defaults()
    return {name: "model" if name in found else "playground" for name in MODEL_FIELDS}


def _number(raw: dict, name: str, start: dict) -> float:
    low, high = RANGES[name]
    try:
        value = float(raw.get(name, start[name]))
    except (TypeError, ValueError):
        raise InvalidParams(name, "must be a number") from None
    if not low <= value <= high:
        raise InvalidParams(name, f"must be between {low:g} and {high:g}")
    return value


def _optional_int(raw: dict, name: str, minimum: int, start: dict) -> int | None:
    value = raw.get(name, start[name])
    if value in (None, ""):
        return None
    try:
        value = int(value)
    except (TypeError, ValueError):
        raise InvalidParams(name, "must be a whole number") from None
    if value < minimum:
        raise InvalidParams(name, f"must be at least {minimum}")
    return value


def _stop(raw: dict) -> list[str]:
    value = raw.get("stop") or []
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
        raise InvalidParams("stop", "must be a list of strings")
    value = [s for s in value if s]
    if len(value) > MAX_STOP_SEQUENCES:
        raise InvalidParams("stop", f"at most {MAX_STOP_SEQUENCES} sequences")
    return value


def clean(raw: dict | None) -> dict:
    """Validated parameters with defaults filled in; raises InvalidParams naming the field."""
    raw, start = dict(raw or {}), defaults()
    params = {name: _number(raw, name, start) for name in RANGES}
    params["top_k"] = _optional_int(raw, "top_k", 0, start) or 0
    params["max_tokens"] = _optional_int(raw, "max_tokens", 1, start) or start["max_tokens"]
    params["seed"] = _optional_int(raw, "seed", 0, start)
    params["stop"] = _stop(raw)
    return params


def sampling_params(params: dict) -> dict:
    """The engine's SamplingParams fields for these playground parameters."""
    names = (
        "temperature",
        "top_p",
        "top_k",
        "repetition_penalty",
        "max_tokens",
        "presence_penalty",
        "frequency_penalty",
    )
    sp = {k: params[k] for k in names if params.get(k) is not None}
    if params.get("seed") is not None:
        sp["seed"] = params["seed"]
    if params.get("stop"):
        sp["stop"] = list(params["stop"])
    return sp
