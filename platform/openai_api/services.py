"""The /v1 generation flow: admit (authenticate, validate, reserve quota), queue, stream, settle, record.

Views call handle_generation(); everything a request goes through lives here in order, and the
quota reservation / settlement happens in exactly one place (reserve_quota() / _finish()).
"""
from __future__ import annotations

import asyncio
import json
import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from asgiref.sync import sync_to_async
from django.conf import settings
from django.db import close_old_connections
from django.http import JsonResponse, StreamingHttpResponse
from rest_framework import serializers

from accounts.authentication import bearer_token
from accounts.services import authenticate_api_key
from engine_client import client as engine
from errors import AuthenticationFailed, EngineFailure, EngineUnavailable, InvalidRequest, NotFound, ServiceError
from inference import protocol
from quotas import selectors as quota_selectors
from quotas import services as quotas
from usage.services import record_usage

from . import formatting, tokenization
from .errors import error_response, sse_error
from .serializers import UNSUPPORTED_NEUTRAL, UNSUPPORTED_PARAMS
from .serializers import (ChatCompletionRequestSerializer, CompletionRequestSerializer, DetokenizeRequestSerializer,
                          TokenizeRequestSerializer)

log = logging.getLogger("tessera.api")

ENDPOINTS = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}
QUOTA_RENEW_S = 30.0
WORKERS_MAX_AGE_S = 1.0


@dataclass
class Generation:
    """One /v1 generation request as it moves through the flow."""

    endpoint: str  # "chat" or "completions"
    user: object = None
    api_key: object = None
    model: str = ""
    request_id: str = ""
    created: int = field(default_factory=lambda: int(time.time()))
    started: float = field(default_factory=time.perf_counter)
    prompt_token_ids: list[int] = field(default_factory=list)
    sampling_params: dict = field(default_factory=dict)
    n: int = 1
    max_tokens: int = 0
    stream: bool = False
    include_usage: bool = False
    logprobs: int | None = None
    echo: bool = False  # completions: each choice starts with the prompt (and its logprobs)
    echo_only: bool = False  # completions max_tokens 0 with echo: the prompt alone, nothing generated
    prompt_texts: list[str] = field(default_factory=list)  # echo: each prompt's text
    prompts: list[list[int]] = field(default_factory=list)  # completions: every prompt of a batched request
    priority: int = 0
    end_user: str = ""  # the request's OpenAI `user` field, recorded on its usage row
    reservation: object = None
    headers: dict = field(default_factory=dict)
    # outcome
    ttft_ms: float | None = None  # from the HTTP request's arrival (usage.models.UsageRecord)
    engine_ttft_ms: float | None = None  # from the worker's acceptance (the finish event's metrics)
    completion_tokens: int = 0
    usage: dict | None = None
    status_code: int = 200
    error_code: str = ""
    finished: bool = False

    @property
    def all_prompts(self) -> list[list[int]]:
        return self.prompts or [self.prompt_token_ids]

    @property
    def prompt_tokens(self) -> int:
        return sum(len(p) for p in self.all_prompts)

    @property
    def longest_prompt_tokens(self) -> int:
        return max(len(p) for p in self.all_prompts)

    @property
    def num_choices(self) -> int:
        return len(self.all_prompts) * self.n

    @property
    def engine_request_ids(self) -> list[str]:
        """One engine request per prompt; a single prompt's is the response id itself."""
        if len(self.all_prompts) == 1:
            return [self.request_id]
        return [f"{self.request_id}-{i}" for i in range(len(self.all_prompts))]


# ---------------------------------------------------------------- the bookkeeping thread

# Admission, quota renewal and settlement (database + Redis) run on one dedicated thread, first
# come first served. On Django's per-request threads a burst of 24 requests ran 24 admissions side
# by side under the GIL, so each one finished ~280 ms late instead of the first after ~4 ms.
_bookkeeping = ThreadPoolExecutor(max_workers=1, thread_name_prefix="api-bookkeeping")


def bookkeeping(fn):
    """fn as a coroutine function that runs on the bookkeeping thread."""
    def run(*args, **kwargs):
        close_old_connections()  # this thread never sees request_finished: honour CONN_MAX_AGE here
        return fn(*args, **kwargs)

    return sync_to_async(run, thread_sensitive=False, executor=_bookkeeping)


# ---------------------------------------------------------------- models and workers

def configured_model_name() -> str:
    return getattr(settings, "SERVED_MODEL_NAME", "") or os.path.basename(os.path.normpath(settings.MODEL))


def models_from_workers(workers: list[dict]) -> dict[str, dict]:
    """served name -> {"max_model_len", "model_path", "created"} from live heartbeats (+ the configured model)."""
    models = {}
    for worker in workers:
        config = worker.get("config") or {}
        for name in worker.get("served_model_names") or [worker.get("model")]:
            if name and name not in models:
                models[name] = {"max_model_len": config.get("max_model_len"), "model_path": config.get("model_path"),
                                "created": int(worker.get("started_at", 0))}
    return models


async def served_models() -> dict[str, dict]:
    """What /v1/models lists: the names (aliases included) that live workers serve right now."""
    return models_from_workers(await engine.aclient().workers())


def model_card(name: str, info: dict) -> dict:
    return {"id": name, "object": "model", "created": info.get("created") or 0, "owned_by": "tessera",
            "max_model_len": info.get("max_model_len")}


_warm = threading.Event()


def warm_up_in_background() -> None:
    """Import the engine's SamplingParams and load the served tokenizer before the first request needs them."""
    if _warm.is_set():
        return
    _warm.set()

    def warm():
        try:
            import inference.sampling_params  # noqa: F401  (pulls in torch: seconds)

            if os.path.isdir(settings.MODEL):
                tokenization.tokenizer_for(settings.MODEL)
        except Exception as exc:  # a broken model folder is reported by the request that needs it
            log.warning("warm-up failed: %s", exc)

    threading.Thread(target=warm, name="api-warm-up", daemon=True).start()


# ---------------------------------------------------------------- request parsing

def authenticate(request, gen: Generation) -> None:
    raw = bearer_token(request.headers.get("Authorization"))
    if raw is None:
        raise AuthenticationFailed("You didn't provide an API key. Pass it as 'Authorization: Bearer <key>'.",
                                   code="missing_api_key")
    key = authenticate_api_key(raw)
    if key is None:
        raise AuthenticationFailed("Incorrect API key provided.")
    gen.api_key, gen.user = key, key.user


def parse_json(request) -> dict:
    try:
        body = json.loads(request.body or b"")
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise InvalidRequest(f"We could not parse the JSON body of your request: {exc}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise InvalidRequest("The request body must be a JSON object.", code="invalid_json")
    return body


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
        for key, item in (value.items() if isinstance(value, dict) else []):
            check_json_types(field.child, item, f"{path}.{key}")
    else:
        for kind, types, name in JSON_TYPES:
            if isinstance(field, kind) and (not isinstance(value, types) or (bool not in types and isinstance(value, bool))):
                raise InvalidRequest(f"Invalid type for '{path}': expected {name}, got {type(value).__name__} "
                                     f"{json.dumps(value)[:40]}.", param=path, code="invalid_type")


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


# ---------------------------------------------------------------- building the engine request

SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty", "frequency_penalty",
                   "repetition_penalty", "min_tokens", "ignore_eos", "stop_token_ids", "skip_special_tokens",
                   "include_stop_str_in_output", "logit_bias", "allowed_token_ids", "bad_words")
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
    spec = response_format_spec(value) if source == "response_format" else (
        value if source == "structured_outputs" else {GUIDED_KINDS[source]: value})
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
        param = message.split(" ", 1)[0].removeprefix("SamplingParams.") if message.startswith("SamplingParams.") else None
        raise InvalidRequest(message, param=param) from None


def context_check(gen: Generation, requested_max: int | None, max_model_len: int | None, prompt_param: str,
                  default_cap: int | None = None) -> int:
    """The max_tokens to use; 400 when prompt + completion cannot fit the model's context (each prompt's).

    Without max_tokens a request may use the rest of the context, but no more than default_cap
    (the plan's per-request cap split over n choices), so omitting it never trips the plan.
    """
    if max_model_len is None:
        return requested_max or min(16, default_cap or 16)
    longest = gen.longest_prompt_tokens  # every prompt of a batch must fit
    if longest >= max_model_len or (requested_max and longest + requested_max > max_model_len):
        asked = longest + (requested_max or 0)
        raise InvalidRequest(f"This model's maximum context length is {max_model_len} tokens. However, you "
                             f"requested {asked} tokens ({longest} in the {prompt_param}, "
                             f"{requested_max or 0} in the completion). Please reduce the length.",
                             param=prompt_param, code="context_length_exceeded")
    return requested_max or min(max_model_len - longest, default_cap or max_model_len)


def default_max_tokens_cap(plan, n: int) -> int | None:
    cap = plan.max_tokens_per_request
    return max(1, cap // n) if cap else None


def admit(request, gen: Generation) -> None:
    """Everything that can refuse a request (401, 400, 404, 503, 429), then the quota reservation.

    Synchronous on purpose: the view runs it in one hop to the bookkeeping thread (each thread hop
    cost about a millisecond of TTFT, and there were five).
    """
    authenticate(request, gen)
    body = parse_json(request)
    data = validate(ChatCompletionRequestSerializer if gen.endpoint == "chat" else CompletionRequestSerializer, body)
    gen.model, gen.stream, gen.end_user = data["model"], data["stream"], data.get("user") or ""
    gen.include_usage = bool(gen.stream and (data.get("stream_options") or {}).get("include_usage"))
    gen.n, gen.priority = data.get("n") or 1, data.get("priority") or 0
    info = resolve_model(gen.model)
    requested, prompt_param = apply_prompt(gen, data, info.get("model_path") or settings.MODEL)
    plan = quota_selectors.plan_for(gen.user)
    default_cap = None if requested else default_max_tokens_cap(plan, gen.n)
    gen.max_tokens = context_check(gen, requested, info.get("max_model_len"), prompt_param, default_cap)
    gen.sampling_params = sampling_params(data, gen.max_tokens, gen.logprobs)
    check_sampling_params(gen.sampling_params)
    reserve_quota(gen, plan)


def check_token_ids(data: dict, vocab_size: int) -> None:
    """Token ids (and top_k) beyond the served tokenizer's vocabulary are a 400 naming the field."""
    if (data.get("top_k") or 0) > vocab_size:
        raise InvalidRequest(f"top_k must be at most the vocabulary size ({vocab_size}), or -1 for all tokens.",
                             param="top_k")
    for name in ("stop_token_ids", "allowed_token_ids", "logit_bias"):
        outside = [t for t in (data.get(name) or []) if t >= vocab_size]
        if outside:
            raise InvalidRequest(f"{name} has token ids outside the vocabulary [0, {vocab_size}): {outside[:5]}",
                                 param=name)


def resolve_model(name: str) -> dict:
    """The live workers' facts about `name`: 404 for a model no live worker serves (requests are
    routed by name, so nobody else would answer it); 503 for the configured model while no worker
    at all is up (a restart, not a wrong name).

    A snapshot up to WORKERS_MAX_AGE_S old is good enough: a worker that died since then fails the
    request with worker_lost / no_worker through the stream instead of an error up front.
    """
    workers = engine.client().workers(max_age=WORKERS_MAX_AGE_S)
    models = models_from_workers(workers)
    if name in models:
        return models[name]
    if not workers and name == configured_model_name():
        raise EngineUnavailable("No engine worker is running; try again shortly.")
    raise NotFound(f"The model '{name}' does not exist or no engine worker is serving it.", param="model",
                   code="model_not_found")


def apply_prompt(gen: Generation, data: dict, path: str) -> tuple[int | None, str]:
    """Tokenize the prompt and set logprobs (shared with the batch runner, which builds the same
    requests), and check token ids against its vocabulary. Returns (requested max_tokens, the prompt's param name)."""
    requested, prompt_param = (chat_prompt if gen.endpoint == "chat" else completion_prompt)(gen, data, path)
    check_token_ids(data, len(tokenization.tokenizer_for(path)))
    if requested is None and gen.endpoint == "completions":
        requested = COMPLETIONS_DEFAULT_MAX_TOKENS
    return requested, prompt_param


def chat_prompt(gen: Generation, data: dict, path: str) -> tuple[int | None, str]:
    """Render the messages with the model's chat template."""
    if data.get("top_logprobs") is not None and not data.get("logprobs"):
        raise InvalidRequest("top_logprobs requires logprobs to be true.", param="top_logprobs")
    messages = [{"role": m["role"], "content": m.get("content") or "", **({"name": m["name"]} if "name" in m else {})}
                for m in data["messages"]]
    gen.prompt_token_ids = tokenization.chat_prompt_ids(path, messages)
    gen.logprobs = (data.get("top_logprobs") or 0) if data.get("logprobs") else None
    return data.get("max_completion_tokens") or data.get("max_tokens"), "messages"


def completion_prompt(gen: Generation, data: dict, path: str) -> tuple[int | None, str]:
    if data.get("best_of") not in (None, gen.n):
        raise InvalidRequest("best_of must equal n (or be omitted).", param="best_of")
    prompts = data["prompt"]
    check_prompt_token_ids(prompts, len(tokenization.tokenizer_for(path)))
    gen.prompts = [list(p) if isinstance(p, list) else tokenization.text_prompt_ids(path, p) for p in prompts]
    gen.prompt_token_ids = gen.prompts[0]
    gen.logprobs = data.get("logprobs")
    gen.echo = data.get("echo", False)
    if gen.echo:
        gen.prompt_texts = [p if isinstance(p, str) else tokenization.decode(path, ids)
                            for p, ids in zip(prompts, gen.prompts)]
    # The engine always generates at least one token; with max_tokens 0 the answer leaves it out.
    gen.echo_only = data.get("max_tokens") == 0
    return (1 if gen.echo_only else data.get("max_tokens")), "prompt"


def check_prompt_token_ids(prompts: list, vocab_size: int) -> None:
    """A token prompt must stay inside the vocabulary (echo decodes it here; the engine would refuse it)."""
    for i, prompt in enumerate(prompts):
        if isinstance(prompt, list) and max(prompt) >= vocab_size:
            raise InvalidRequest(f"The prompt has token ids outside the vocabulary [0, {vocab_size}).",
                                 param="prompt" if len(prompts) == 1 else f"prompt[{i}]")


# ---------------------------------------------------------------- admission, streaming, settlement

def reserve_quota(gen: Generation, plan) -> None:
    """The only place /v1 calls quotas.reserve; the same plan feeds the x-ratelimit headers."""
    try:
        gen.reservation = quotas.reserve(gen.user, gen.model, gen.prompt_tokens, gen.max_tokens * gen.num_choices,
                                         "api", plan=plan)
    except quotas.PlanViolation as exc:
        if exc.code == "max_tokens_exceeded" and gen.n > 1:
            exc.message += f" With n={gen.n}, n x max_tokens counts against that cap."
        raise
    gen.headers = quotas.rate_limit_headers(gen.user, plan)


async def events(gen: Generation):
    """The request's engine events; whatever ends it (finish, error, disconnect) settles and records once."""
    terminal = False
    last_renew = time.monotonic()
    try:
        async for event in engine_events(gen):
            kind = event["type"]
            if kind == "delta" and event.get("token_ids"):
                gen.completion_tokens += len(event["token_ids"])
                if gen.ttft_ms is None:
                    gen.ttft_ms = (time.perf_counter() - gen.started) * 1000
            elif kind == "finish":
                gen.usage, terminal = event.get("usage"), True
                gen.engine_ttft_ms = (event.get("metrics") or {}).get("ttft_ms")
            elif kind == "error":
                failure, terminal = EngineFailure.from_event(event), True
                gen.status_code, gen.error_code = failure.status, failure.code
            if time.monotonic() - last_renew > QUOTA_RENEW_S:
                last_renew = time.monotonic()
                await bookkeeping(quotas.renew)(gen.reservation)
            yield event
    finally:
        if not terminal:  # the client went away mid-stream: free the engine's blocks now
            gen.status_code, gen.error_code = 499, "client_disconnected"
            await abort_all(gen)
        await _finish(gen)


async def engine_events(gen: Generation):
    """The events of the request's engine requests, one per prompt, read in prompt order (they run
    side by side in the engine) as one request's: choice i of prompt p is index p * n + i, and one
    finish closes them all with the usage summed. An error aborts the prompts still running."""
    client, timeout = engine.aclient(), getattr(settings, "API_REQUEST_TIMEOUT", 3600)
    if len(gen.engine_request_ids) == 1:
        async for event in client.stream(gen.request_id, model=gen.model, timeout=timeout):
            yield event
        return
    reasons, usage, metrics = [], protocol.empty_usage(), {}
    for prompt_index, request_id in enumerate(gen.engine_request_ids):
        async for event in client.stream(request_id, model=gen.model, timeout=timeout):
            if event["type"] == "error":
                await abort_all(gen)
                yield event
                return
            if event["type"] == "finish":
                reasons.extend(event.get("finish_reasons") or [None] * gen.n)
                for name in usage:
                    usage[name] += (event.get("usage") or {}).get(name, 0)
                metrics = metrics or event.get("metrics") or {}
                continue
            yield _for_prompt(event, prompt_index, gen.n)
    yield protocol.finish_event(reasons, usage, metrics)


def _for_prompt(event: dict, prompt_index: int, n: int) -> dict:
    if event["type"] == "delta":
        return {**event, "index": prompt_index * n + event["index"]}
    if event["type"] == "prompt_logprobs":
        return {**event, "prompt_index": prompt_index}
    return event


async def abort_all(gen: Generation) -> None:
    for request_id in gen.engine_request_ids:
        await engine.aclient().abort(request_id)


async def _finish(gen: Generation) -> None:
    if gen.finished:
        return
    gen.finished = True
    usage = gen.usage or {"prompt_tokens": gen.prompt_tokens, "completion_tokens": gen.completion_tokens,
                          "cached_tokens": 0}
    latency_ms = (time.perf_counter() - gen.started) * 1000
    # A client that hangs up right after its last chunk cancels this task; the settlement runs on
    # regardless (shielded, referenced until done), or its concurrency slot stays held for the lease.
    settling = asyncio.ensure_future(bookkeeping(settle_and_record)(gen, usage, latency_ms))
    _settling.add(settling)
    settling.add_done_callback(_settling.discard)
    try:
        await asyncio.shield(settling)
    except Exception:  # bookkeeping must never turn a delivered answer into a 500
        log.exception("settling request %s failed", gen.request_id)


_settling: set[asyncio.Task] = set()


def settle_and_record(gen: Generation, usage: dict, latency_ms: float) -> None:
    """Settle the quota reservation with the real token counts and write the usage row."""
    if gen.reservation is not None:
        quotas.settle(gen.reservation, usage["prompt_tokens"], usage["completion_tokens"])
    if gen.user is None:
        return
    record_usage(
        user=gen.user, api_key=gen.api_key, source="api", endpoint=ENDPOINTS[gen.endpoint], model=gen.model,
        request_id=gen.request_id, prompt_tokens=usage.get("prompt_tokens", gen.prompt_tokens),
        completion_tokens=usage.get("completion_tokens", 0), cached_tokens=usage.get("cached_tokens", 0),
        ttft_ms=gen.ttft_ms, engine_ttft_ms=gen.engine_ttft_ms, latency_ms=latency_ms, status_code=gen.status_code,
        error_code=gen.error_code, end_user=gen.end_user)


# ---------------------------------------------------------------- vLLM's tokenizer routes

async def tokenizer_model(name: str | None) -> tuple[str, int | None]:
    """(tokenizer path, max_model_len) of a served model; the configured model when none is named.

    The web tier holds the tokenizers itself, so these routes work while no engine worker is up.
    """
    models = await served_models()
    name = name or configured_model_name()
    if name in models:
        return models[name].get("model_path") or settings.MODEL, models[name].get("max_model_len")
    if name == configured_model_name():
        return settings.MODEL, None
    raise NotFound(f"The model '{name}' does not exist or no engine worker is serving it.", param="model",
                   code="model_not_found")


def tokenize_body(data: dict, path: str, max_model_len: int | None) -> dict:
    ids, strs = tokenization.tokenize(path, data)
    return {"count": len(ids), "max_model_len": max_model_len, "tokens": ids, "token_strs": strs}


def detokenize_body(data: dict, path: str) -> dict:
    vocab = len(tokenization.tokenizer_for(path))
    bad = next((i for i, t in enumerate(data["tokens"]) if t >= vocab), None)
    if bad is not None:
        raise InvalidRequest(f"token id {data['tokens'][bad]} is outside the vocabulary (size {vocab}).",
                             param=f"tokens[{bad}]")
    return {"prompt": tokenization.decode(path, data["tokens"])}


async def handle_tokenizer_route(request, route: str):
    """POST /tokenize, POST /detokenize, GET /tokenizer_info (vLLM's; lm-eval probes them)."""
    try:
        await bookkeeping(authenticate)(request, Generation(endpoint=route))
        data = {}
        if route != "tokenizer_info":
            serializer = TokenizeRequestSerializer if route == "tokenize" else DetokenizeRequestSerializer
            data = validate(serializer, parse_json(request))
        path, max_model_len = await tokenizer_model(data.get("model"))
        work = {"tokenize": lambda: tokenize_body(data, path, max_model_len),
                "detokenize": lambda: detokenize_body(data, path),
                "tokenizer_info": lambda: tokenization.tokenizer_info(path)}[route]
        return JsonResponse(await sync_to_async(work, thread_sensitive=False)())
    except ServiceError as error:
        return error_response(error)


# ---------------------------------------------------------------- the whole request

async def handle_generation(request, endpoint: str):
    """POST /v1/chat/completions and /v1/completions."""
    gen = Generation(endpoint=endpoint)
    gen.request_id = ("chatcmpl-" if endpoint == "chat" else "cmpl-") + protocol.new_request_id()
    try:
        await bookkeeping(admit)(request, gen)
        for request_id, prompt in zip(gen.engine_request_ids, gen.all_prompts):
            await engine.aclient().submit(model=gen.model, prompt_token_ids=prompt,
                                          sampling_params=gen.sampling_params, priority_class="api",
                                          priority=gen.priority, user=gen.user.pk, request_id=request_id)
        if gen.stream:
            return await _streaming_response(gen)
        return await _json_response(gen)
    except ServiceError as error:
        gen.status_code, gen.error_code = error.status, error.code
        if gen.reservation is not None or gen.user is not None:
            await _finish(gen)
        response = error_response(error)
        for name, value in {**gen.headers, **error.headers}.items():
            response[name] = value
        return response
    except Exception:  # e.g. Redis went away between admission and submit (the middleware answers 503)
        if gen.reservation is not None:  # settled now (or once Redis is back), not when its lease ends
            gen.status_code, gen.error_code = 503, "service_unavailable"
            await _finish(gen)
        raise


async def _json_response(gen: Generation):
    result = engine.new_result()
    async for event in events(gen):
        engine.fold(result, event)
    if result["error"]:
        raise EngineFailure.from_event(result["error"])
    engine.finalize(result, gen.num_choices)
    body = (formatting.chat_response if gen.endpoint == "chat" else formatting.completion_response)(gen, result)
    response = JsonResponse(body)
    for name, value in gen.headers.items():
        response[name] = value
    return response


async def _streaming_response(gen: Generation):
    """SSE. The first engine event is awaited before answering, so early failures keep their HTTP status."""
    stream = events(gen)
    first = await anext(stream)
    if first["type"] == "error":
        await stream.aclose()
        raise EngineFailure.from_event(first)
    response = StreamingHttpResponse(_sse(gen, first, stream), content_type="text/event-stream")
    response["Cache-Control"] = "no-cache"
    response["X-Accel-Buffering"] = "no"  # proxies must not buffer tokens
    for name, value in gen.headers.items():
        response[name] = value
    return response


async def _sse(gen: Generation, first: dict, stream):
    writer = formatting.ChunkWriter(gen)
    finished: set[int] = set()
    try:
        for chunk in writer.start():
            yield chunk
        event = first
        while True:
            if event["type"] == "delta":
                if event.get("finish_reason"):
                    finished.add(event["index"])
                for chunk in writer.delta(event):
                    yield chunk
            elif event["type"] == "prompt_logprobs":
                for chunk in writer.prompt_logprobs(event):
                    yield chunk
            elif event["type"] == "finish":
                for chunk in writer.finish(event, finished):
                    yield chunk
                break
            elif event["type"] == "error":
                yield sse_error(EngineFailure.from_event(event))
                break
            event = await anext(stream, None)
            if event is None:
                break
        yield formatting.DONE
    finally:
        await stream.aclose()  # runs events()' clean-up: abort on disconnect, settle, record usage
