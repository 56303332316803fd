"""Thin async views of the OpenAI-compatible API; the flow itself lives in services.py.

The views are DRF APIView subclasses only so drf-spectacular documents them from the same
serializers that validate requests; they are dispatched as plain async Django views (DRF has no
async support, and SSE streams must stay on the event loop).
"""
from __future__ import annotations

from asgiref.sync import markcoroutinefunction, sync_to_async
from django.http import HttpResponse, JsonResponse
from drf_spectacular.utils import OpenApiResponse, extend_schema
from rest_framework.parsers import JSONParser
from rest_framework.views import APIView

from accounts.authentication import ApiKeyAuthentication
from engine_client import client as engine
from errors import NotFound, ServiceError

from . import metrics, services
from .errors import error_response
from .serializers import (ChatCompletionRequestSerializer, ChatCompletionSerializer, CompletionRequestSerializer,
                          CompletionSerializer, DetokenizeRequestSerializer, DetokenizeSerializer, ErrorSerializer,
                          HealthSerializer, ModelListSerializer, ModelSerializer, TokenizeRequestSerializer,
                          TokenizerInfoSerializer, TokenizeSerializer)

ERRORS = {status: OpenApiResponse(ErrorSerializer, description=why) for status, why in {
    400: "invalid parameter (error.param names it), malformed JSON, prompt longer than the context",
    401: "missing or invalid API key", 404: "unknown model", 429: "quota or rate limit (Retry-After set)",
    503: "no engine worker alive"}.items()}
STREAM_NOTE = ("With stream=true the response is text/event-stream: `data: {chunk}` lines ending with "
               "`data: [DONE]`; stream_options.include_usage adds a final chunk with empty choices and usage.")


class AsyncAPIView(APIView):
    """Documented like a DRF view, dispatched as an async Django view."""

    authentication_classes = [ApiKeyAuthentication]
    permission_classes = []
    parser_classes = [JSONParser]  # the schema's request bodies: JSON only (services.parse_json reads them)

    @classmethod
    def as_view(cls, **initkwargs):
        async def view(request, *args, **kwargs):
            handler = getattr(cls(**initkwargs), request.method.lower(), None)
            if handler is None:
                return error_response(ServiceError(f"Method {request.method} is not allowed on {request.path}.",
                                                   status=405, code="method_not_allowed"))
            return await handler(request, *args, **kwargs)

        markcoroutinefunction(view)
        view.cls, view.initkwargs, view.csrf_exempt = cls, initkwargs, True
        return view


class ChatCompletionsView(AsyncAPIView):
    @extend_schema(operation_id="createChatCompletion", request=ChatCompletionRequestSerializer,
                   responses={200: ChatCompletionSerializer, **ERRORS}, description=STREAM_NOTE)
    async def post(self, request):
        return await services.handle_generation(request, "chat")


class CompletionsView(AsyncAPIView):
    @extend_schema(operation_id="createCompletion", request=CompletionRequestSerializer,
                   responses={200: CompletionSerializer, **ERRORS}, description=STREAM_NOTE)
    async def post(self, request):
        return await services.handle_generation(request, "completions")


async def _authenticated(request) -> ServiceError | None:
    try:
        await services.bookkeeping(services.authenticate)(request, services.Generation(endpoint="models"))
    except ServiceError as error:
        return error
    return None


class ModelListView(AsyncAPIView):
    @extend_schema(operation_id="listModels", responses={200: ModelListSerializer, 401: ERRORS[401]})
    async def get(self, request):
        if error := await _authenticated(request):
            return error_response(error)
        models = await services.served_models()
        return JsonResponse({"object": "list", "data": [services.model_card(n, i) for n, i in sorted(models.items())]})


class ModelDetailView(AsyncAPIView):
    @extend_schema(operation_id="retrieveModel", responses={200: ModelSerializer, 401: ERRORS[401], 404: ERRORS[404]})
    async def get(self, request, model: str):
        if error := await _authenticated(request):
            return error_response(error)
        models = await services.served_models()
        if model not in models:
            return error_response(NotFound(f"The model '{model}' does not exist.", param="model",
                                           code="model_not_found"))
        return JsonResponse(services.model_card(model, models[model]))


class TokenizeView(AsyncAPIView):
    @extend_schema(operation_id="tokenize", request=TokenizeRequestSerializer,
                   responses={200: TokenizeSerializer, **ERRORS}, description="vLLM's /tokenize.")
    async def post(self, request):
        return await services.handle_tokenizer_route(request, "tokenize")


class DetokenizeView(AsyncAPIView):
    @extend_schema(operation_id="detokenize", request=DetokenizeRequestSerializer,
                   responses={200: DetokenizeSerializer, **ERRORS}, description="vLLM's /detokenize.")
    async def post(self, request):
        return await services.handle_tokenizer_route(request, "detokenize")


class TokenizerInfoView(AsyncAPIView):
    @extend_schema(operation_id="tokenizerInfo", responses={200: TokenizerInfoSerializer, 401: ERRORS[401]},
                   description="vLLM's /tokenizer_info: the tokenizer's class, special tokens and chat template.")
    async def get(self, request):
        return await services.handle_tokenizer_route(request, "tokenizer_info")


class HealthView(AsyncAPIView):
    authentication_classes = []

    @extend_schema(operation_id="health", responses={200: HealthSerializer, 503: HealthSerializer},
                   description="200 while at least one engine worker has a fresh heartbeat, else 503.")
    async def get(self, request):
        services.warm_up_in_background()  # load balancers and the live tests ping this first
        state = await engine.aclient().health()
        body = {"status": "ok" if state["ok"] else "unavailable", "engine": state["ok"],
                "redis": state["redis"], "workers": state["workers"]}
        return JsonResponse(body, status=200 if state["ok"] else 503)


class MetricsView(AsyncAPIView):
    authentication_classes = []

    @extend_schema(operation_id="metrics", responses={(200, "text/plain"): str},
                   description="Prometheus text format: engine gauges per worker and HTTP counters.")
    async def get(self, request):
        text = await sync_to_async(metrics.render, thread_sensitive=False)()
        return HttpResponse(text, content_type="text/plain; version=0.0.4; charset=utf-8")
