"""The served model's tokenizer in the web tier: chat templates and token counts for quotas."""
from __future__ import annotations

import threading
from functools import lru_cache

from jinja2 import TemplateError

from errors import InvalidRequest

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
    """Render messages with the model's chat template (generation prompt added) and tokenize.

    OpenAI's developer role is the system role of the models' templates; a template that refuses
    the conversation (raise_exception on a role) or a tokenizer without one is a 400 on messages.
    """
    tok = tokenizer_for(path)
    if not getattr(tok, "chat_template", None):
        raise InvalidRequest("This model's tokenizer has no chat template; use /v1/completions with a prompt.",
                             param="messages", code="no_chat_template")
    messages = [{**m, "role": "system"} if m["role"] == "developer" else m for m in messages]
    try:
        text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    except TemplateError as exc:
        raise InvalidRequest(f"The model's chat template refused these messages: {exc}", param="messages",
                             code="chat_template_error") from None
    # The template writes the BOS token itself; adding special tokens again would double it.
    return list(tok.encode(text, add_special_tokens=False))


def text_prompt_ids(path: str, prompt: str) -> list[int]:
    return list(tokenizer_for(path).encode(prompt))


def decode(path: str, token_ids: list[int]) -> str:
    return tokenizer_for(path).decode(token_ids)


def tokenize(path: str, data: dict) -> tuple[list[int], list[str] | None]:
    """vLLM's /tokenize: the prompt's (or the rendered messages') ids, and their token strings if asked."""
    tok = tokenizer_for(path)
    if "messages" in data:
        ids = chat_prompt_ids(path, [{"role": m["role"], "content": m.get("content") or ""} for m in data["messages"]])
    else:
        ids = list(tok.encode(data["prompt"], add_special_tokens=data["add_special_tokens"]))
    return ids, (tok.convert_ids_to_tokens(ids) if data["return_token_strs"] else None)


def tokenizer_info(path: str) -> dict:
    """vLLM's /tokenizer_info: the tokenizer's class, special tokens and chat template."""
    tok = tokenizer_for(path)
    template = tok.chat_template if isinstance(tok.chat_template, str) else None
    return {"tokenizer_class": type(tok).__name__, "bos_token": tok.bos_token, "eos_token": tok.eos_token,
            "pad_token": tok.pad_token, "unk_token": tok.unk_token,
            "model_max_length": tok.model_max_length if tok.model_max_length < 10**9 else None,
            "chat_template": template}
