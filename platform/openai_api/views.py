"""The OpenAI-compatible API's HTTP side: authenticate, parse, answer with JSON or SSE.

The work itself is elsewhere: calls.build_call turns a body into an ApiCall, and the generation
service (generation.services) admits, submits, follows and finishes it. The views are DRF
APIView subclasses only so drf-spectacular documents them from the same serializers that
validate requests; they are dispatched as plain async Django views (DRF has no async support,
and SSE streams must stay on the event loop).
"""

from __future__ import annotations

import json
import logging
import os
import threading

from asgiref.sync import markcoroutinefunction, sync_to_async
from django.conf import settings
from django.http import HttpResponse, JsonResponse, StreamingHttpResponse
from drf_spectacular.utils import OpenApiResponse, extend_schema
from rest_framework.parsers import JSONParser
from rest_framework.views import APIView

from accounts.authentication import ApiKeyAuthentication, bearer_token
from engine_client import client as engine
from errors import AuthenticationFailed, EngineFailure, InvalidRequest, NotFound, ServiceError
from generation import catalog, tokenization
from generation import services as generation
from generation.services import on_bookkeeping_thread

from . import calls, credentials, formatting, metrics
from .errors import error_response, sse_error
from .serializers import (
    ChatCompletionRequestSerializer,
    ChatCompletionSerializer,
    CompletionRequestSerializer,
    CompletionSerializer,
    DetokenizeRequestSerializer,
    DetokenizeSerializer,
    ErrorSerializer,
    HealthSerializer,
    ModelListSerializer,
    ModelSerializer,
    TokenizeRequestSerializer,
    TokenizerInfoSerializer,
    TokenizeSerializer,
)

log = logging.getLogger("tessera.api")

ERRORS = {
    status: OpenApiResponse(ErrorSerializer, description=why)
    for status, why in {
        400: "invalid parameter (error.param names it), malformed JSON, prompt longer than the context",
        401: "missing or invalid API key",
        404: "unknown model",
        429: "quota or rate limit (Retry-After set)",
        503: "no engine worker alive",
    }.items()
}
STREAM_NOTE = (
    "With stream=true the response is text/event-stream: `data: {chunk}` lines ending with "
    "`data: [DONE]`; stream_options.include_usage adds a final chunk with empty choices and usage."
)


class AsyncAPIView(APIView):
    """Documented like a DRF view, dispatched as an async Django view."""

    authentication_classes = [ApiKeyAuthentication]
    permission_classes = []
    parser_classes = [JSONParser]  # the schema's request bodies: JSON only (views.parse_json reads them)

    @classmethod
    def as_view(cls, **initkwargs):
        async def view(request, *args, **kwargs):
            handler = getattr(cls(**initkwargs), request.method.lower(), None)
            if handler is None:
                return error_response(
                    ServiceError(
                        f"Method {request.method} is not allowed on {request.path}.",
                        status=405,
                        code="method_not_allowed",
                    )
                )
            return await handler(request, *args, **kwargs)

        markcoroutinefunction(view)
        view.cls, view.initkwargs, view.csrf_exempt = cls, initkwargs, True
        return view


class ChatCompletionsView(AsyncAPIView):
    @extend_schema(
        operation_id="createChatCompletion",
        request=ChatCompletionRequestSerializer,
        responses={200: ChatCompletionSerializer, **ERRORS},
        description=STREAM_NOTE,
    )
    async def post(self, request):
        return await generate(request, "chat")


class CompletionsView(AsyncAPIView):
    @extend_schema(
        operation_id="createCompletion",
        request=CompletionRequestSerializer,
        responses={200: CompletionSerializer, **ERRORS},
        description=STREAM_NOTE,
    )
    async def post(self, request):
        return await generate(request, "completions")


async def _authenticated(request) -> ServiceError | None:
    try:
        await on_bookkeeping_thread(authenticate, request)
    except ServiceError as error:
        return error
    return None


def model_card(name: str, info: dict) -> dict:
    return {
        "id": name,
        "object": "model",
        "created": info.get("created") or 0,
        "owned_by": "tessera",
        "max_model_len": info.get("max_model_len"),
    }


class ModelListView(AsyncAPIView):
    @extend_schema(operation_id="listModels", responses={200: ModelListSerializer, 401: ERRORS[401]})
    async def get(self, request):
        if error := await _authenticated(request):
            return error_response(error)
        models = await catalog.served_models()
        return JsonResponse({"object": "list", "data": [model_card(n, i) for n, i in sorted(models.items())]})


class ModelDetailView(AsyncAPIView):
    @extend_schema(operation_id="retrieveModel", responses={200: ModelSerializer, 401: ERRORS[401], 404: ERRORS[404]})
    async def get(self, request, model: str):
        if error := await _authenticated(request):
            return error_response(error)
        models = await catalog.served_models()
        if model not in models:
            return error_response(
                NotFound(f"The model '{model}' does not exist.", param="model", code="model_not_found")
            )
        return JsonResponse(model_card(model, models[model]))


class TokenizeView(AsyncAPIView):
    @extend_schema(
        operation_id="tokenize",
        request=TokenizeRequestSerializer,
        responses={200: TokenizeSerializer, **ERRORS},
        description="vLLM's /tokenize.",
    )
    async def post(self, request):
        return await tokenizer_route(request, "tokenize")


class DetokenizeView(AsyncAPIView):
    @extend_schema(
        operation_id="detokenize",
        request=DetokenizeRequestSerializer,
        responses={200: DetokenizeSerializer, **ERRORS},
        description="vLLM's /detokenize.",
    )
    async def post(self, request):
        return await tokenizer_route(request, "detokenize")


class TokenizerInfoView(AsyncAPIView):
    @extend_schema(
        operation_id="tokenizerInfo",
        responses={200: TokenizerInfoSerializer, 401: ERRORS[401]},
        description="vLLM's /tokenizer_info: the tokenizer's class, special tokens and chat template.",
    )
    async def get(self, request):
        return await tokenizer_route(request, "tokenizer_info")


class HealthView(AsyncAPIView):
    authentication_classes = []

    @extend_schema(
        operation_id="health",
        responses={200: HealthSerializer, 503: HealthSerializer},
        description="200 while at least one engine worker has a fresh heartbeat, else 503.",
    )
    async def get(self, request):
        warm_up_in_background()  # load balancers and the live tests ping this first
        state = await engine.aclient().health()
        body = {
            "status": "ok" if state["ok"] else "unavailable",
            "engine": state["ok"],
            "redis": state["redis"],
            "workers": state["workers"],
        }
        return JsonResponse(body, status=200 if state["ok"] else 503)


class MetricsView(AsyncAPIView):
    authentication_classes = []

    @extend_schema(
        operation_id="metrics",
        responses={(200, "text/plain"): str},
        description="Prometheus text format: engine gauges per worker and HTTP counters.",
    )
    async def get(self, request):
        text = await sync_to_async(metrics.render, thread_sensitive=False)()
        return HttpResponse(text, content_type="text/plain; version=0.0.4; charset=utf-8")


# ---------------------------------------------------------------- a generation over HTTP


def authenticate(request):
    """The request's API key and its user's plan (401 without a valid key)."""
    raw = bearer_token(request.headers.get("Authorization"))
    if raw is None:
        raise AuthenticationFailed(
            "You didn't provide an API key. Pass it as 'Authorization: Bearer <key>'.", code="missing_api_key"
        )
    known = credentials.caller(raw)
    if known is None:
        raise AuthenticationFailed("Incorrect API key provided.")
    return known


def parse_json(request) -> dict:
    try:
        body = json.loads(request.body or b"")
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise InvalidRequest(f"We could not parse the JSON body of your request: {exc}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise InvalidRequest("The request body must be a JSON object.", code="invalid_json")
    return body


def admit(request, kind: str, lease_id: str) -> calls.ApiCall:
    """Everything that can refuse a request (401, 400, 404, 503, 429), the quota reservation, then
    the engine requests, submitted with the event loop's lease (lease_id).

    Synchronous on purpose: the view runs it in one hop to the bookkeeping thread (each thread hop
    cost about a millisecond of TTFT, and there were five). A refusal by the quota is recorded as
    the request's usage row (the dashboard charts error rates).
    """
    key, plan = authenticate(request)
    call = calls.build_call(kind=kind, body=parse_json(request), user=key.user, api_key=key, plan=plan)
    return start(call, plan, lease_id)


def start(call: calls.ApiCall, plan, lease_id: str) -> calls.ApiCall:
    """The quota reservation, then the engine requests (every /v1 generation, /v1/responses too)."""
    try:
        calls.admit(call, plan)
        generation.submit(call.gen, lease_id=lease_id)
    except Exception as exc:  # a refusal, or Redis gone mid-admission (the middleware answers 503)
        status, code = (exc.status, exc.code) if isinstance(exc, ServiceError) else (503, "service_unavailable")
        call.gen.fail(status, code)
        generation.finish(call.gen)  # its usage row; a reservation made before Redis failed is released
        raise
    return call


LARGE_BODY_BYTES = 64 * 1024  # about 16k tokens of text: tokenizing it takes tens of milliseconds


async def generate(request, kind: str):
    """POST /v1/chat/completions and /v1/completions."""
    try:
        call = await on_bookkeeping_thread(
            admit, request, kind, engine.aclient().lease(), large=len(request.body) > LARGE_BODY_BYTES
        )
    except ServiceError as error:
        return _with_headers(error_response(error), error.headers)
    events = _events(call.gen)
    try:
        if call.stream:
            return await _streaming_response(call, events)
        return await _json_response(call, events)
    except ServiceError as error:
        return _with_headers(error_response(error), {**call.headers, **error.headers})


async def _events(gen: generation.Generation):
    """The generation's events; whatever ends them (finish, error, disconnect) finishes it once."""
    try:
        async for event in generation.follow(gen, timeout=getattr(settings, "API_REQUEST_TIMEOUT", 3600)):
            yield event
    finally:
        await _finish(gen)


async def _finish(gen: generation.Generation) -> None:
    try:
        await generation.afinish(gen)
    except Exception:  # bookkeeping must never turn a delivered answer into a 500
        log.exception("finishing request %s failed", gen.request_id)


def _with_headers(response, headers: dict):
    for name, value in headers.items():
        response[name] = value
    return response


async def _json_response(call: calls.ApiCall, events):
    async for _event in events:
        pass
    if call.gen.result.error:
        raise EngineFailure.from_event(call.gen.result.error)
    return _with_headers(JsonResponse(formatting.response_body(call, call.gen.result)), call.headers)


async def _streaming_response(call: calls.ApiCall, events):
    """SSE. The first engine event is awaited before answering, so early failures keep their HTTP status."""
    first = await anext(events)
    if first["type"] == "error":
        await events.aclose()
        raise EngineFailure.from_event(first)
    response = StreamingHttpResponse(_sse(call, first, events), content_type="text/event-stream")
    response["Cache-Control"] = "no-cache"
    response["X-Accel-Buffering"] = "no"  # proxies must not buffer tokens
    return _with_headers(response, call.headers)


async def _sse(call: calls.ApiCall, first: dict, events):
    writer = formatting.ChunkWriter(call)
    finished: set[int] = set()
    try:
        for chunk in writer.start():
            yield chunk
        event = first
        while event is not None:
            for chunk in _chunks(writer, event, finished):
                yield chunk
            if event["type"] in ("finish", "error"):
                break
            event = await anext(events, None)
        yield formatting.DONE
    finally:
        await events.aclose()  # runs _events' clean-up: abort on disconnect, finish once


def _chunks(writer: formatting.ChunkWriter, event: dict, finished: set[int]) -> list[bytes]:
    kind = event["type"]
    if kind == "delta":
        if event.get("finish_reason"):
            finished.add(event["index"])
        return writer.delta(event)
    if kind == "prompt_logprobs":
        return writer.prompt_logprobs(event)
    if kind == "finish":
        return writer.finish(event, finished)
    if kind == "error":
        return [sse_error(EngineFailure.from_event(event))]
    return []


# ---------------------------------------------------------------- vLLM's tokenizer routes


async def tokenizer_route(request, route: str):
    """POST /tokenize, POST /detokenize, GET /tokenizer_info (vLLM's; lm-eval probes them)."""
    try:
        await on_bookkeeping_thread(authenticate, request)
        data = {}
        if route != "tokenizer_info":
            serializer = TokenizeRequestSerializer if route == "tokenize" else DetokenizeRequestSerializer
            data = calls.validate(serializer, parse_json(request))
        path, max_model_len = calls.tokenizer_model(data.get("model"), await catalog.served_models())
        work = {
            "tokenize": lambda: calls.tokenize_body(data, path, max_model_len),
            "detokenize": lambda: calls.detokenize_body(data, path),
            "tokenizer_info": lambda: tokenization.tokenizer_info(path),
        }[route]
        return JsonResponse(await sync_to_async(work, thread_sensitive=False)())
    except ServiceError as error:
        return error_response(error)


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
