"""Turn a conversation branch into prompt token ids with the served model's chat template.

Tokenization is shared with the /v1 API (generation.tokenization), so the playground and the API
count the same tokens for the same messages.
"""

from __future__ import annotations

from django.conf import settings

from generation import catalog, tokenization


def served_model_name() -> str:
    return catalog.configured_model_name()


def available_models() -> list[str]:
    """Names the live engine workers serve, plus the configured one (the only model when none is up);
    embedding models cannot chat, so they are left out."""
    return sorted(name for name, info in catalog.known_models().items() if info.get("task") != "embed")


def model_path(model: str) -> str:
    """The folder whose tokenizer and chat template `model` uses (requests are routed by name, so a
    prompt must be built for the model that will run it)."""
    return catalog.known_models().get(model, {}).get("model_path") or str(settings.MODEL)


def tokenizer():
    return tokenization.tokenizer_for(str(settings.MODEL))


def prompt_token_ids(model: str, system_prompt: str, turns: list[dict]) -> list[int]:
    """turns: [{"role": "user"|"assistant", "content": str}, ...] ending with the user's turn."""
    messages = ([{"role": "system", "content": system_prompt}] if system_prompt.strip() else []) + turns
    return tokenization.chat_prompt_ids(model_path(model), messages)
