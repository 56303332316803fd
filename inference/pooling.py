"""Pooling of an encoder's token states into one embedding per prompt, as sentence-transformers does it.

A sentence-transformers folder says how in modules.json: a Pooling module (its config.json names
the mode: CLS token, mean or max over the tokens) and, when listed, a Normalize module (unit L2
length). A plain BERT folder without that config pools the CLS token and normalises, as vLLM's
embedding runner does. `dimensions` (OpenAI's parameter) truncates and renormalises, which only
means something for models trained for it (Matryoshka); config.json says so with
`matryoshka_dimensions` or `is_matryoshka`, as vLLM reads them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

POOLING_MODES = {"pooling_mode_cls_token": "cls", "pooling_mode_mean_tokens": "mean", "pooling_mode_max_tokens": "max"}


@dataclass
class PoolingParams:
    """Per-request options of an embedding (vLLM's PoolingParams)."""

    dimensions: int | None = None  # truncate (Matryoshka models only) and renormalise
    # what the worker's output state reads of every request's parameters: one result, no logprobs
    n = 1
    logprobs = None
    prompt_logprobs = None

    def __post_init__(self):
        if self.dimensions is not None and (
            isinstance(self.dimensions, bool) or not isinstance(self.dimensions, int) or self.dimensions < 1
        ):
            raise ValueError(f"dimensions must be a positive integer; got {self.dimensions!r}")


@dataclass(frozen=True)
class PoolingConfig:
    mode: str  # "cls" | "mean" | "max"
    normalize: bool
    dimension: int  # the model's embedding size
    max_seq_length: int | None = None  # sentence-transformers' limit on the prompt, tokens
    matryoshka_dimensions: tuple[int, ...] | None = None  # None: no truncation allowed; () any size

    @classmethod
    def from_folder(cls, path: str, hidden_size: int, raw_config: dict) -> "PoolingConfig":
        folder = Path(path)
        modules = _read_json(folder / "modules.json") or []
        kinds = {m.get("type", "").rsplit(".", 1)[-1]: m for m in modules}
        mode, normalize = "cls", True  # vLLM's default for a BERT embedding model
        if "Pooling" in kinds:
            mode = pooling_mode(_read_json(folder / kinds["Pooling"].get("path", "") / "config.json") or {})
            normalize = "Normalize" in kinds
        st_config = _read_json(folder / "sentence_bert_config.json") or {}
        return cls(
            mode=mode,
            normalize=normalize,
            dimension=hidden_size,
            max_seq_length=st_config.get("max_seq_length"),
            matryoshka_dimensions=_matryoshka(raw_config),
        )

    def check_dimensions(self, dimensions: int | None) -> None:
        """ValueError naming `dimensions` when this model cannot give that size."""
        if dimensions is None or dimensions == self.dimension:
            return
        if self.matryoshka_dimensions is None:
            raise ValueError(
                f"dimensions: this model does not support other output sizes than {self.dimension} "
                "(it was not trained for truncated embeddings)"
            )
        allowed = self.matryoshka_dimensions
        if not 1 <= dimensions <= self.dimension or (allowed and dimensions not in allowed):
            sizes = ", ".join(map(str, allowed)) if allowed else f"1..{self.dimension}"
            raise ValueError(f"dimensions must be one of {sizes} for this model; got {dimensions}")


def pooling_mode(config: dict) -> str:
    modes = [name for key, name in POOLING_MODES.items() if config.get(key)]
    unsupported = [
        key for key, value in config.items() if key.startswith("pooling_mode") and value and key not in POOLING_MODES
    ]
    if unsupported or len(modes) != 1:
        raise ValueError(
            f"unsupported sentence-transformers pooling {unsupported or modes}: one of "
            f"{', '.join(POOLING_MODES)} is supported"
        )
    return modes[0]


def _matryoshka(raw: dict) -> tuple[int, ...] | None:
    if raw.get("matryoshka_dimensions"):
        return tuple(int(d) for d in raw["matryoshka_dimensions"])
    return () if raw.get("is_matryoshka") else None


def _read_json(file: Path):
    return json.loads(file.read_text()) if file.is_file() else None


def pool(hidden: torch.Tensor, lengths: list[int], mode: str) -> torch.Tensor:
    """[tokens, hidden] of several prompts laid end to end -> [prompts, hidden], in float32."""
    rows = []
    for states in hidden.float().split(lengths):
        if mode == "cls":
            rows.append(states[0])
        elif mode == "mean":
            rows.append(states.mean(dim=0))
        else:
            rows.append(states.max(dim=0).values)
    return torch.stack(rows)


def finish_embedding(vector: torch.Tensor, config: PoolingConfig, dimensions: int | None) -> torch.Tensor:
    """Truncate to `dimensions` (checked before), then normalise as the model says."""
    if dimensions is not None:
        vector = vector[:dimensions]
    if config.normalize or (dimensions is not None and dimensions != config.dimension):
        vector = torch.nn.functional.normalize(vector, p=2, dim=-1)
    return vector
