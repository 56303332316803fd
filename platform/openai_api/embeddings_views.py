"""POST /v1/embeddings over HTTP: authenticate, parse, answer with OpenAI's embedding list.

Admission is views.start's path (one hop to the bookkeeping thread: authenticate, build, reserve,
submit); the engine's events are followed and finished once by views' generation events, like
every other /v1 answer.
"""

from __future__ import annotations

from django.http import JsonResponse
from drf_spectacular.utils import extend_schema

from engine_client import client as engine
from errors import EngineFailure, ServiceError
from generation.services import on_bookkeeping_thread

from . import embeddings, views
from .embeddings_serializers import EmbeddingListSerializer, EmbeddingRequestSerializer
from .errors import error_response
from .views import ERRORS, LARGE_BODY_BYTES, AsyncAPIView, authenticate, parse_json, start


class EmbeddingsView(AsyncAPIView):
    @extend_schema(
        operation_id="createEmbedding",
        request=EmbeddingRequestSerializer,
        responses={200: EmbeddingListSerializer, **ERRORS},
        description="Embeddings of an encoder model an engine worker serves (task 'embed').",
    )
    async def post(self, request):
        try:
            call = await on_bookkeeping_thread(
                admit, request, engine.aclient().lease(), large=len(request.body) > LARGE_BODY_BYTES
            )
        except ServiceError as error:
            return views._with_headers(error_response(error), error.headers)
        try:
            async for _event in views._events(call.gen):
                pass
            if call.gen.result.error:
                raise EngineFailure.from_event(call.gen.result.error)
            return views._with_headers(JsonResponse(embeddings.response_body(call, call.gen.result)), call.headers)
        except ServiceError as error:
            return views._with_headers(error_response(error), {**call.headers, **error.headers})


def admit(request, lease_id: str) -> embeddings.EmbeddingCall:
    key, plan = authenticate(request)
    call = embeddings.build_call(body=parse_json(request), user=key.user, api_key=key)
    start(call, plan, lease_id)
    return call
