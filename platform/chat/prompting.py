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


def available_models() -> list[str]:
    """Names the live engine workers serve, plus the configured one (the only model when none is up)."""
    from engine_client import client as engine

    try:
        names = {name for w in engine.workers() for name in w["served_model_names"]}
    except Exception:  # Redis down: the page still renders; submitting will report the error
        names = set()
    names.discard("")
    names.add(served_model_name())
    return sorted(names)


def tokenizer():
    return tokenization.tokenizer_for(str(settings.MODEL))


def prompt_token_ids(system_prompt: str, turns: list[dict]) -> list[int]:
    """turns: [{"role": "user"|"assistant", "content": str}, ...] ending with the user's turn."""
    messages = ([{"role": "system", "content": system_prompt}] if system_prompt.strip() else []) + turns
    return tokenization.chat_prompt_ids(str(settings.MODEL), messages)
