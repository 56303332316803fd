"""The served model's tokenizer in the web tier: chat templates and token counts for quotas."""

from __future__ import annotations

import json
import logging
import re
import threading
from functools import lru_cache

from jinja2 import TemplateError

from errors import InvalidRequest

_lock = threading.Lock()
log = logging.getLogger("tessera.tokenization")


@lru_cache(maxsize=8)
def _load(path: str):
    # The engine's own loader: a HF folder or a GGUF file tokenizes here exactly as in the engine.
    from inference.loader import load_tokenizer

    return load_tokenizer(path)


def tokenizer_for(path: str):
    with _lock:  # one load per path even when the first requests arrive together
        return _load(path)


@lru_cache(maxsize=8)
def longest_token_chars(path: str) -> int:
    """The most characters one token of this tokenizer can stand for: its longest vocabulary piece
    (a byte-level piece has a symbol per byte, a decoded character at least one byte)."""
    return max(1, max(len(piece) for piece in tokenizer_for(path).get_vocab()))


def warm_up(path: str) -> bool:
    """Load `path`'s tokenizer, render its chat template once and find its longest piece, now: a web
    process does it before it listens, so the first request after `ready:` does not wait for them
    (seconds for a GGUF file's tokenizer; a pass over the vocabulary for the prompt-length check).
    False (logged) when the model cannot be loaded here; requests then say why, as they would without
    this."""
    try:
        tok = tokenizer_for(path)
        if getattr(tok, "chat_template", None):
            chat_prompt_ids(path, [{"role": "user", "content": "Hello"}])
        else:
            tok.encode("Hello")
        longest_token_chars(path)
    except Exception as exc:  # never a reason not to serve: the engine side may still answer
        log.warning("the tokenizer of %s did not load before serving: %s", path, exc)
        return False
    return True


def chat_prompt_ids(path: str, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
    """Render messages (and the tools offered) with the model's chat template and tokenize.

    OpenAI's developer role is the system role of the models' templates; a template that refuses
    the conversation (raise_exception on a role) or a tokenizer without one is a 400 on messages.
    A template that knows tools gets them and the tool turns in HF's convention; one that does not
    (SmolLM2's plain ChatML, the test models') gets them in the Hermes convention as text, which
    openai_api.tool_calls' "hermes" parser reads back.
    """
    tok = tokenizer_for(path)
    if not getattr(tok, "chat_template", None):
        raise InvalidRequest(
            "This model's tokenizer has no chat template; use /v1/completions with a prompt.",
            param="messages",
            code="no_chat_template",
        )
    messages = [{**m, "role": "system"} if m["role"] == "developer" else m for m in messages]
    template = _template_source(tok)
    extra = {}
    if "tools" in template:
        messages = [_with_argument_objects(m, i) for i, m in enumerate(messages)]
        if tools:
            extra["tools"] = tools
    else:
        messages = _hermes_messages(messages, tools, tool_role=bool(re.search(r"\btool\b", template)))
    try:
        text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **extra)
    except (TemplateError, TypeError) as exc:  # TypeError: a template adding a null content to a string
        raise InvalidRequest(
            f"The model's chat template refused these messages: {exc}", param="messages", code="chat_template_error"
        ) from None
    # The template writes the BOS token itself; adding special tokens again would double it.
    return list(tok.encode(text, add_special_tokens=False))


def _template_source(tok) -> str:
    template = tok.chat_template
    if isinstance(template, dict):  # several named templates ("default", "tool_use")
        return "\n".join(str(t) for t in template.values())
    return template if isinstance(template, str) else ""


def _with_argument_objects(message: dict, i: int) -> dict:
    """HF templates take a call's arguments as an object (they tojson it); OpenAI sends JSON text."""
    if not message.get("tool_calls"):
        return message
    calls = [
        {
            **call,
            "type": "function",
            "function": {"name": call["function"]["name"], "arguments": _arguments(call, i, j)},
        }
        for j, call in enumerate(message["tool_calls"])
    ]
    return {**message, "tool_calls": calls}


def _arguments(call: dict, i: int, j: int):
    arguments = call["function"].get("arguments")
    if not isinstance(arguments, str):
        return arguments if arguments is not None else {}
    try:
        return json.loads(arguments) if arguments.strip() else {}
    except ValueError:
        raise InvalidRequest(
            "A tool call's arguments must be JSON text.", param=f"messages[{i}].tool_calls[{j}].function.arguments"
        ) from None


# Qwen2.5's wording of the Hermes convention, for templates that know nothing of tools.
HERMES_TOOLS_PROMPT = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>'
)


def _hermes_messages(messages: list[dict], tools: list[dict] | None, tool_role: bool) -> list[dict]:
    """The conversation in plain turns: tools in the system text, calls and results as tagged text.

    Tool results stay in role "tool" where the template names that role; elsewhere they become
    one user turn per run of results (templates that alternate user/assistant accept that).
    """
    out: list[dict] = []
    joining = False  # the last turn is a user turn of tool results, which the next result joins
    for i, message in enumerate(messages):
        role = message["role"]
        if role == "tool" and not tool_role:
            response = f"<tool_response>\n{_text(message.get('content'))}\n</tool_response>"
            if joining:
                out[-1]["content"] += "\n" + response
            else:
                out.append({"role": "user", "content": response})
            joining = True
            continue
        joining = False
        if role == "assistant" and message.get("tool_calls"):
            out.append({"role": "assistant", "content": _hermes_calls_text(message, i)})
        elif role == "tool":
            out.append({"role": "tool", "content": _text(message.get("content"))})
        else:
            out.append(message)
    if tools:
        out = _with_tools_in_system(out, tools)
    return out


def _hermes_calls_text(message: dict, i: int) -> str:
    content = _text(message.get("content"))
    parts = [content] if content else []
    for j, call in enumerate(message["tool_calls"]):
        body = json.dumps({"name": call["function"]["name"], "arguments": _arguments(call, i, j)}, ensure_ascii=False)
        parts.append(f"<tool_call>\n{body}\n</tool_call>")
    return "\n".join(parts)


def _with_tools_in_system(messages: list[dict], tools: list[dict]) -> list[dict]:
    listing = "\n".join(json.dumps(tool, ensure_ascii=False) for tool in tools)
    prompt = HERMES_TOOLS_PROMPT.format(tools=listing)
    if messages and messages[0]["role"] == "system":
        system = _text(messages[0].get("content"))
        return [{**messages[0], "content": f"{system}\n\n{prompt}" if system else prompt}, *messages[1:]]
    return [{"role": "system", "content": prompt}, *messages]


def _text(content) -> str:
    """A message's content as text: a string, content parts (their text joined) or nothing."""
    if content is None:
        return ""
    if isinstance(content, list):
        return "".join(part.get("text", "") for part in content if isinstance(part, dict))
    return str(content)


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
    return {
        "tokenizer_class": type(tok).__name__,
        "bos_token": tok.bos_token,
        "eos_token": tok.eos_token,
        "pad_token": tok.pad_token,
        "unk_token": tok.unk_token,
        "model_max_length": tok.model_max_length if tok.model_max_length < 10**9 else None,
        "chat_template": template,
    }
