"""An OpenAI request body -> an ApiCall: the engine's Generation plus how its answer is shaped.

The /v1 views and the batch runner both build their work here, so a batch line and the same
request sent to /v1/chat/completions give the same engine request and the same response body.
No `request` objects: the views parse HTTP and pass the body, the user and the plan in.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field

from django.conf import settings
from rest_framework import serializers

from errors import InvalidRequest, NotFound, ServiceError
from generation import catalog, tokenization
from generation.services import Generation
from generation.services import admit as admit_generation
from inference import protocol
from quotas import services as quotas

from . import tool_calls
from .serializers import (
    UNSUPPORTED_NEUTRAL,
    UNSUPPORTED_PARAMS,
    ChatCompletionRequestSerializer,
    CompletionRequestSerializer,
)

log = logging.getLogger("tessera.api")

SERIALIZERS = {"chat": ChatCompletionRequestSerializer, "completions": CompletionRequestSerializer}
ENDPOINTS = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}
ID_PREFIXES = {"chat": "chatcmpl-", "completions": "cmpl-"}


@dataclass
class ApiCall:
    """One /v1 generation: what runs (gen) and how the answer is shaped for the client."""

    kind: str  # "chat" | "completions"
    gen: Generation
    created: int = field(default_factory=lambda: int(time.time()))
    stream: bool = False
    include_usage: bool = False
    logprobs: int | None = None
    echo: bool = False  # completions: each choice starts with the prompt (and its logprobs)
    echo_only: bool = False  # completions max_tokens 0 with echo: the prompt alone, nothing generated
    prompt_texts: list[str] = field(default_factory=list)  # echo: each prompt's text
    headers: dict = field(default_factory=dict)  # x-ratelimit-*
    tools: "ToolUse | None" = None  # chat with tools: how the answer's text becomes tool calls

    @property
    def request_id(self) -> str:
        return self.gen.request_id

    @property
    def model(self) -> str:
        return self.gen.model

    @property
    def n(self) -> int:
        return self.gen.n


@dataclass(frozen=True)
class ToolUse:
    """How a chat answer's text becomes tool calls: a forced choice (the engine's grammar made the
    model write JSON) or the model family's own format, read by its parser (vLLM's tool parsers)."""

    tool_choice: object  # "auto" | "required" | {"type": "function", "function": {"name": ...}}
    parser: str  # tool_calls.PARSERS key, for "auto"
    parallel: bool = True

    @property
    def forced(self) -> bool:
        return self.tool_choice != "auto"

    @property
    def named(self) -> bool:
        return tool_calls.forced_name(self.tool_choice) is not None

    def stream(self) -> tool_calls.ToolStream:
        return tool_calls.forced_stream(self.tool_choice) if self.forced else tool_calls.PARSERS[self.parser]().stream()

    def parse(self, text: str) -> tool_calls.ParsedOutput:
        if self.forced:
            return tool_calls.parse_forced(text, self.tool_choice)
        parsed = tool_calls.PARSERS[self.parser]().parse(text)
        if not self.parallel:  # one call at most, as the client asked (the format itself cannot say so)
            parsed.tool_calls = parsed.tool_calls[:1]
        return parsed

    def finish_reason(self, reason: str | None, called: bool) -> str | None:
        """OpenAI's: "tool_calls" when the model called tools of its own choice (a named choice stays "stop")."""
        return "tool_calls" if called and reason == "stop" and not self.named else reason


def tool_use(data: dict, path: str) -> ToolUse | None:
    """The request's tools, checked; None when no call can come back (no tools, or tool_choice "none")."""
    tools, choice = data.get("tools"), data.get("tool_choice")
    tool_calls.validate_tools(tools, choice, data.get("parallel_tool_calls"))
    choice = choice or ("auto" if tools else "none")
    if not tools or choice == "none":
        return None
    override = getattr(settings, "TOOL_CALL_PARSER", "") or None
    try:
        parser = tool_calls.choose_parser(tokenization.tokenizer_for(path), override)
    except ValueError as exc:  # a misconfigured TOOL_CALL_PARSER: the operator's error, named
        raise ServiceError(str(exc), param="tools", code="tool_parser_unavailable", status=500) from None
    return ToolUse(tool_choice=choice, parser=parser, parallel=data.get("parallel_tool_calls") is not False)


def add_tool_sampling(params: dict, data: dict, tools: ToolUse | None) -> None:
    """A forced choice is enforced by the grammar; the Llama 3 and Mistral markers are special tokens
    the answer must keep for the parser to see them."""
    if tools is None:
        return
    if tools.forced:
        if "structured_outputs" in params:
            raise InvalidRequest(
                "A forced tool_choice cannot be combined with response_format or structured "
                "outputs: both constrain the whole answer.",
                param="tool_choice",
            )
        params["structured_outputs"] = tool_calls.forced_spec(data["tools"], tools.tool_choice, tools.parallel)
    elif tools.parser != "hermes" and data.get("skip_special_tokens") is None:
        params["skip_special_tokens"] = False


# ---------------------------------------------------------------- the whole build


def build_call(
    *,
    kind: str,
    body: dict,
    user,
    source: str = "api",
    endpoint: str | None = None,
    api_key=None,
    models: dict | None = None,
    plan=None,
    request_id: str | None = None,
) -> ApiCall:
    """Validate the body and build the engine request (errors.ServiceError for anything refused).

    models: the served models to look the model up in (a batch waits for workers); None asks the
    live workers, where an unknown model is a 404. plan: caps an omitted max_tokens (the API).
    request_id: the front door's own id (a Responses API response id); default chatcmpl-/cmpl-."""
    data = validate(SERIALIZERS[kind], body)
    model, n = data["model"], data.get("n") or 1
    info = catalog.resolve_model(model) if models is None else models.get(model, {})
    path = info.get("model_path") or str(settings.MODEL)
    shape = {"stream": data.get("stream", False)}
    shape["include_usage"] = bool(shape["stream"] and (data.get("stream_options") or {}).get("include_usage"))
    check_prompt_chars(data, kind, path, info.get("max_model_len"))
    prompts, requested, prompt_param = (chat_prompt if kind == "chat" else completion_prompt)(data, path, shape)
    check_token_ids(data, len(tokenization.tokenizer_for(path)))
    shape["tools"] = tool_use(data, path) if kind == "chat" else None
    default_cap = default_max_tokens_cap(plan, n) if plan is not None and not requested else None
    max_tokens = context_check(
        max(len(p) for p in prompts), requested, info.get("max_model_len"), prompt_param, default_cap
    )
    params = sampling_params(data, max_tokens, shape.get("logprobs"))
    add_tool_sampling(params, data, shape["tools"])
    check_sampling_params(params)
    gen = Generation(
        source=source,
        endpoint=endpoint or ENDPOINTS[kind],
        user=user,
        api_key=api_key,
        model=model,
        prompts=prompts,
        sampling_params=params,
        n=n,
        max_tokens=max_tokens,
        priority=data.get("priority") or 0,
        end_user=data.get("user") or "",
        request_id=request_id or ID_PREFIXES[kind] + protocol.new_request_id(),
    )
    return ApiCall(kind=kind, gen=gen, **shape)


def admit(call: ApiCall, plan) -> None:
    """Reserve the quota; the same plan feeds the x-ratelimit headers."""
    try:
        admit_generation(call.gen, plan=plan)
    except quotas.PlanViolation as exc:
        if exc.code == "max_tokens_exceeded" and call.n > 1:
            exc.message += f" With n={call.n}, n x max_tokens counts against that cap."
        raise
    call.headers = quotas.rate_limit_headers(call.gen.user, plan, call.gen.reservation.usage)


# ---------------------------------------------------------------- prompts


def check_prompt_chars(data: dict, kind: str, path: str, max_model_len: int | None) -> None:
    """Refuse a prompt that cannot fit the context before tokenizing it: a megabyte of text takes
    the tokenizer a second, and its answer would be a 400 anyway. Exact, never an estimate: a text
    of C characters is at least C / tokenization.longest_token_chars tokens."""
    if max_model_len is None:
        return
    texts = (
        [m.get("content") for m in data["messages"]]
        if kind == "chat"
        else [p for p in data["prompt"] if isinstance(p, str)]
    )
    chars = sum(len(t) for t in texts if isinstance(t, str)) if kind == "chat" else max(map(len, texts), default=0)
    at_least = -(-chars // tokenization.longest_token_chars(path))
    if at_least >= max_model_len:
        param = "messages" if kind == "chat" else "prompt"
        raise InvalidRequest(
            f"This model's maximum context length is {max_model_len} tokens. However, your "
            f"{param} has {chars} characters, at least {at_least} tokens. Please reduce the length.",
            param=param,
            code="context_length_exceeded",
        )


def chat_prompt(data: dict, path: str, shape: dict) -> tuple[list[list[int]], int | None, str]:
    """Render the messages with the model's chat template: (prompts, requested max_tokens, param)."""
    if data.get("top_logprobs") is not None and not data.get("logprobs"):
        raise InvalidRequest("top_logprobs requires logprobs to be true.", param="top_logprobs")
    check_tool_turns(data["messages"])
    messages = [prompt_message(m) for m in data["messages"]]
    shape["logprobs"] = (data.get("top_logprobs") or 0) if data.get("logprobs") else None
    prompt = tokenization.chat_prompt_ids(path, messages, tools=data.get("tools") or None)
    return [prompt], data.get("max_completion_tokens") or data.get("max_tokens"), "messages"


def check_tool_turns(messages: list[dict]) -> None:
    """A tool message answers a call an earlier assistant message made (OpenAI refuses it otherwise)."""
    called: set[str] = set()
    for i, message in enumerate(messages):
        called.update(call["id"] for call in message.get("tool_calls") or [])
        if message["role"] == "tool" and message["tool_call_id"] not in called:
            raise InvalidRequest(
                "A tool message must answer a tool call of an earlier assistant message: no call "
                f"has the id {message['tool_call_id']!r}.",
                param=f"messages[{i}].tool_call_id",
            )


def prompt_message(message: dict) -> dict:
    """A message as the chat template takes it: the tool turns keep their call ids, names and calls."""
    out = {"role": message["role"], "content": message.get("content") or ""}
    for key in ("name", "tool_call_id"):
        if message.get(key):
            out[key] = message[key]
    if message.get("tool_calls"):
        out["tool_calls"] = json.loads(json.dumps(message["tool_calls"]))  # plain dicts, not DRF's
    return out


COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's and vLLM's default on /v1/completions


def completion_prompt(data: dict, path: str, shape: dict) -> tuple[list[list[int]], int | None, str]:
    """Every prompt of the request (a string or token ids each), echo and logprobs settings."""
    if data.get("best_of") not in (None, data.get("n") or 1):
        raise InvalidRequest("best_of must equal n (or be omitted).", param="best_of")
    texts = data["prompt"]
    check_prompt_token_ids(texts, len(tokenization.tokenizer_for(path)))
    prompts = [list(p) if isinstance(p, list) else tokenization.text_prompt_ids(path, p) for p in texts]
    shape["logprobs"], shape["echo"] = data.get("logprobs"), data.get("echo", False)
    if shape["echo"]:
        shape["prompt_texts"] = [
            p if isinstance(p, str) else tokenization.decode(path, ids) for p, ids in zip(texts, prompts)
        ]
    # The engine always generates at least one token; with max_tokens 0 the answer leaves it out.
    shape["echo_only"] = data.get("max_tokens") == 0
    requested = 1 if shape["echo_only"] else data.get("max_tokens")
    return prompts, COMPLETIONS_DEFAULT_MAX_TOKENS if requested is None else requested, "prompt"


# ---------------------------------------------------------------- validation


def validate(serializer_cls, body: dict) -> dict:
    serializer = serializer_cls(data=body)
    check_known_params(body, serializer.fields)
    check_json_types(serializer, body)
    if serializer.is_valid():
        return serializer.validated_data
    param, message = _first_error(serializer.errors)
    raise InvalidRequest(f"Invalid value for '{param}': {message}", param=param)


JSON_TYPES = [  # DRF coerces "8" to 8, "0.5" to 0.5, "true" to True and 5 to "5"; a JSON API must not
    (serializers.BooleanField, (bool,), "a boolean"),
    (serializers.IntegerField, (int,), "an integer"),
    (serializers.FloatField, (int, float), "a number"),
    (serializers.CharField, (str,), "a string"),
]


def check_json_types(field, value, path: str = "") -> None:
    """400 naming the field for a JSON value of the wrong type, anywhere in the body."""
    if value is None:
        return
    if isinstance(field, (serializers.ListSerializer, serializers.ListField)):
        for i, item in enumerate(value if isinstance(value, list) else []):
            check_json_types(field.child, item, f"{path}[{i}]")
    elif isinstance(field, serializers.Serializer):
        for name, sub in field.fields.items():
            if isinstance(value, dict) and name in value:
                check_json_types(sub, value[name], f"{path}.{name}" if path else name)
    elif isinstance(field, serializers.DictField):
        for key, item in value.items() if isinstance(value, dict) else []:
            check_json_types(field.child, item, f"{path}.{key}")
    else:
        for kind, types, name in JSON_TYPES:
            if isinstance(field, kind) and (
                not isinstance(value, types) or (bool not in types and isinstance(value, bool))
            ):
                raise InvalidRequest(
                    f"Invalid type for '{path}': expected {name}, got {type(value).__name__} {json.dumps(value)[:40]}.",
                    param=path,
                    code="invalid_type",
                )


def check_known_params(body: dict, fields) -> None:
    """400 for an OpenAI parameter we cannot honour; log (as vLLM does) the harmless and unknown ones."""
    for name, why in UNSUPPORTED_PARAMS.items():
        if body.get(name) is not None and body[name] not in UNSUPPORTED_NEUTRAL.get(name, []):
            raise InvalidRequest(f"'{name}' is not supported: {why}.", param=name, code="unsupported_parameter")
    ignored = sorted(set(body) - set(fields) - set(UNSUPPORTED_PARAMS))
    if ignored:
        log.warning("The following fields were present in the request but ignored: %s", ignored)


def _first_error(errors, prefix="") -> tuple[str, str]:
    if isinstance(errors, list):
        for i, item in enumerate(errors):
            if item:
                if isinstance(item, (dict, list)) and not isinstance(item, str):
                    return _first_error(item, f"{prefix}[{i}]" if prefix else str(i))
                return prefix or "body", str(item)
    if isinstance(errors, dict):
        name, value = next(iter(errors.items()))
        if isinstance(name, int) or (isinstance(name, str) and name.isdigit()):
            path = f"{prefix}[{name}]"
        else:
            path = f"{prefix}.{name}" if prefix else name
        if isinstance(value, list) and value and not isinstance(value[0], (dict, list)):
            return path, str(value[0])
        return _first_error(value, path)
    return prefix or "body", str(errors)


# ---------------------------------------------------------------- the engine request

SAMPLING_FIELDS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "min_tokens",
    "ignore_eos",
    "stop_token_ids",
    "skip_special_tokens",
    "include_stop_str_in_output",
    "logit_bias",
    "allowed_token_ids",
    "bad_words",
    "speculative",
)
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's and vLLM's default on /v1/completions


def sampling_params(data: dict, max_tokens: int, logprobs: int | None) -> dict:
    params = {name: data[name] for name in SAMPLING_FIELDS if data.get(name) is not None}
    params.update(n=data.get("n") or 1, max_tokens=max_tokens)
    if data.get("stop"):
        params["stop"] = data["stop"]
    if logprobs is not None:
        params["logprobs"] = logprobs
        if data.get("echo"):  # completions echo: the prompt's logprobs too (vLLM's prompt_logprobs)
            params["prompt_logprobs"] = logprobs
    structured = structured_outputs(data)
    if structured is not None:
        params["structured_outputs"] = structured
    return params


GUIDED_KINDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


def structured_outputs(data: dict) -> dict | None:
    """OpenAI's response_format or vLLM's structured_outputs / guided_* as the engine's spec; 400 for two."""
    given = [name for name in ("response_format", "structured_outputs", *GUIDED_KINDS) if data.get(name) is not None]
    if data.get("response_format", {}) and data["response_format"]["type"] == "text":
        given.remove("response_format")
    if len(given) > 1:
        raise InvalidRequest(f"give at most one of {', '.join(given)}", param=given[1])
    if not given:
        return None
    source, value = given[0], data[given[0]]
    spec = (
        response_format_spec(value)
        if source == "response_format"
        else (value if source == "structured_outputs" else {GUIDED_KINDS[source]: value})
    )
    check_structured_outputs(spec, source)
    return spec


def response_format_spec(value: dict) -> dict:
    schema = (value.get("json_schema") or {}).get("schema")
    return {"json": schema} if value["type"] == "json_schema" and schema is not None else {"json_object": True}


def check_structured_outputs(spec: dict, source: str) -> None:
    """A spec the grammar library cannot parse is a 400 naming the field it came from (sub-millisecond)."""
    from inference.structured_output import StructuredOutputs, check_syntax

    try:
        check_syntax(StructuredOutputs(**spec))
    except (ValueError, TypeError) as exc:
        raise InvalidRequest(str(exc).strip(), param=source) from None


def check_sampling_params(params: dict) -> None:
    """The engine's own validation, before anything is reserved or queued (names the bad field)."""
    from inference.sampling_params import SamplingParams

    try:
        SamplingParams(**params)
    except (ValueError, TypeError) as exc:
        message = str(exc)
        param = (
            message.split(" ", 1)[0].removeprefix("SamplingParams.") if message.startswith("SamplingParams.") else None
        )
        raise InvalidRequest(message, param=param) from None


def context_check(
    longest: int,
    requested_max: int | None,
    max_model_len: int | None,
    prompt_param: str,
    default_cap: int | None = None,
) -> int:
    """The max_tokens to use; 400 when prompt + completion cannot fit the model's context (each prompt's).

    Without max_tokens a request may use the rest of the context, but no more than default_cap
    (the plan's per-request cap split over n choices), so omitting it never trips the plan.
    """
    if max_model_len is None:
        return requested_max or min(16, default_cap or 16)
    if longest >= max_model_len or (requested_max and longest + requested_max > max_model_len):
        asked = longest + (requested_max or 0)
        raise InvalidRequest(
            f"This model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {asked} tokens ({longest} in the {prompt_param}, "
            f"{requested_max or 0} in the completion). Please reduce the length.",
            param=prompt_param,
            code="context_length_exceeded",
        )
    return requested_max or min(max_model_len - longest, default_cap or max_model_len)


def default_max_tokens_cap(plan, n: int) -> int | None:
    cap = plan.max_tokens_per_request
    return max(1, cap // n) if cap else None


def check_token_ids(data: dict, vocab_size: int) -> None:
    """Token ids (and top_k) beyond the served tokenizer's vocabulary are a 400 naming the field."""
    if (data.get("top_k") or 0) > vocab_size:
        raise InvalidRequest(
            f"top_k must be at most the vocabulary size ({vocab_size}), or -1 for all tokens.", param="top_k"
        )
    for name in ("stop_token_ids", "allowed_token_ids", "logit_bias"):
        outside = [t for t in (data.get(name) or []) if t >= vocab_size]
        if outside:
            raise InvalidRequest(
                f"{name} has token ids outside the vocabulary [0, {vocab_size}): {outside[:5]}", param=name
            )


def check_prompt_token_ids(prompts: list, vocab_size: int) -> None:
    """A token prompt must stay inside the vocabulary (echo decodes it here; the engine would refuse it)."""
    for i, prompt in enumerate(prompts):
        if isinstance(prompt, list) and max(prompt) >= vocab_size:
            raise InvalidRequest(
                f"The prompt has token ids outside the vocabulary [0, {vocab_size}).",
                param="prompt" if len(prompts) == 1 else f"prompt[{i}]",
            )


# ---------------------------------------------------------------- vLLM's tokenizer routes


def tokenizer_model(name: str | None, models: dict) -> tuple[str, int | None]:
    """(tokenizer path, max_model_len) of a served model; the configured model when none is named.

    The web tier holds the tokenizers itself, so these routes work while no engine worker is up.
    """
    name = name or catalog.configured_model_name()
    if name in models:
        return models[name].get("model_path") or str(settings.MODEL), models[name].get("max_model_len")
    if name == catalog.configured_model_name():
        return str(settings.MODEL), None
    raise NotFound(
        f"The model '{name}' does not exist or no engine worker is serving it.", param="model", code="model_not_found"
    )


def tokenize_body(data: dict, path: str, max_model_len: int | None) -> dict:
    ids, strs = tokenization.tokenize(path, data)
    return {"count": len(ids), "max_model_len": max_model_len, "tokens": ids, "token_strs": strs}


def detokenize_body(data: dict, path: str) -> dict:
    vocab = len(tokenization.tokenizer_for(path))
    bad = next((i for i, t in enumerate(data["tokens"]) if t >= vocab), None)
    if bad is not None:
        raise InvalidRequest(
            f"token id {data['tokens'][bad]} is outside the vocabulary (size {vocab}).", param=f"tokens[{bad}]"
        )
    return {"prompt": tokenization.decode(path, data["tokens"])}
