"""Validation of the playground's sampling parameters (the parameters panel)."""
from __future__ import annotations

DEFAULTS = {"temperature": 0.7, "top_p": 1.0, "max_tokens": 256, "seed": None, "stop": [],
            "presence_penalty": 0.0, "frequency_penalty": 0.0}
RANGES = {"temperature": (0.0, 2.0), "top_p": (0.01, 1.0), "presence_penalty": (-2.0, 2.0),
          "frequency_penalty": (-2.0, 2.0)}
MAX_STOP_SEQUENCES = 4


class InvalidParams(ValueError):
    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field


def _number(raw: dict, name: str) -> float:
    low, high = RANGES[name]
    try:
        value = float(raw.get(name, DEFAULTS[name]))
    except (TypeError, ValueError):
        raise InvalidParams(name, "must be a number") from None
    if not low <= value <= high:
        raise InvalidParams(name, f"must be between {low:g} and {high:g}")
    return value


def _optional_int(raw: dict, name: str, minimum: int) -> int | None:
    value = raw.get(name, DEFAULTS[name])
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
    raw = dict(raw or {})
    params = {name: _number(raw, name) for name in RANGES}
    params["max_tokens"] = _optional_int(raw, "max_tokens", 1) or DEFAULTS["max_tokens"]
    params["seed"] = _optional_int(raw, "seed", 0)
    params["stop"] = _stop(raw)
    return params


def sampling_params(params: dict) -> dict:
    """The engine's SamplingParams fields for these playground parameters."""
    sp = {k: params[k] for k in ("temperature", "top_p", "max_tokens", "presence_penalty", "frequency_penalty")}
    if params.get("seed") is not None:
        sp["seed"] = params["seed"]
    if params.get("stop"):
        sp["stop"] = list(params["stop"])
    return sp
