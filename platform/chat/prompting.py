"""Turn a conversation branch into prompt token ids with the served model's chat template."""
from __future__ import annotations

import functools
from pathlib import Path

from django.conf import settings


def served_model_name() -> str:
    return settings.SERVED_MODEL_NAME or Path(str(settings.MODEL)).name


@functools.lru_cache(maxsize=4)
def _tokenizer(path: str):
    from transformers import AutoTokenizer  # heavy import; only the first prompt pays it

    return AutoTokenizer.from_pretrained(path)


def tokenizer():
    return _tokenizer(str(settings.MODEL))


def prompt_token_ids(system_prompt: str, turns: list[dict]) -> list[int]:
    """turns: [{"role": "user"|"assistant", "content": str}, ...] ending with the user's turn."""
    messages = ([{"role": "system", "content": system_prompt}] if system_prompt.strip() else []) + turns
    ids = tokenizer().apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if hasattr(ids, "keys"):  # newer transformers may return a BatchEncoding
        ids = ids["input_ids"]
    return list(ids)
