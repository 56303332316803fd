"""The served model's tokenizer in the web tier: chat templates and token counts for quotas."""
from __future__ import annotations

import threading
from functools import lru_cache

_lock = threading.Lock()


@lru_cache(maxsize=8)
def _load(path: str):
    # The engine's own loader: a HF folder or a GGUF file tokenizes here exactly as in the engine.
    from inference.loader import load_tokenizer

    return load_tokenizer(path)


def tokenizer_for(path: str):
    with _lock:  # one load per path even when the first requests arrive together
        return _load(path)


def chat_prompt_ids(path: str, messages: list[dict]) -> list[int]:
    """Render messages with the model's chat template (generation prompt added) and tokenize."""
    tok = tokenizer_for(path)
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    # The template writes the BOS token itself; adding special tokens again would double it.
    return list(tok.encode(text, add_special_tokens=False))


def text_prompt_ids(path: str, prompt: str) -> list[int]:
    return list(tokenizer_for(path).encode(prompt))
