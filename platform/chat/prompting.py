"""Turn a conversation branch into prompt token ids with the served model's chat template.

Tokenization is shared with the /v1 API (openai_api.tokenization), so the playground and the API
count the same tokens for the same messages.
"""
from __future__ import annotations

from pathlib import Path

from django.conf import settings

from openai_api import tokenization


def served_model_name() -> str:
    return settings.SERVED_MODEL_NAME or Path(str(settings.MODEL)).name


def _model_paths() -> dict[str, str]:
    """Served name -> the model folder its live workers load (their heartbeats), aliases included."""
    from engine_client import client as engine

    try:
        workers = engine.workers()
    except Exception:  # Redis down: the page still renders; submitting will report the error
        workers = []
    return {name: (w.get("config") or {}).get("model_path") or str(settings.MODEL)
            for w in workers for name in w["served_model_names"] if name}


def available_models() -> list[str]:
    """Names the live engine workers serve, plus the configured one (the only model when none is up)."""
    return sorted({*_model_paths(), served_model_name()})


def model_path(model: str) -> str:
    """The folder whose tokenizer and chat template `model` uses (requests are routed by name, so a
    prompt must be built for the model that will run it)."""
    return _model_paths().get(model) or str(settings.MODEL)


def tokenizer():
    return tokenization.tokenizer_for(str(settings.MODEL))


def prompt_token_ids(model: str, system_prompt: str, turns: list[dict]) -> list[int]:
    """turns: [{"role": "user"|"assistant", "content": str}, ...] ending with the user's turn."""
    messages = ([{"role": "system", "content": system_prompt}] if system_prompt.strip() else []) + turns
    return tokenization.chat_prompt_ids(model_path(model), messages)
