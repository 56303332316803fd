"""The Responses API's HTTP side: POST /v1/responses (JSON or its event stream), GET and DELETE
/v1/responses/{id}, GET /v1/responses/{id}/input_items.

Admission is views.admit's path (one hop to the bookkeeping thread: authenticate, build, reserve,
submit, through views.start); the generation is followed and finished by the generation service.
A stored response is saved by finish(save=...), in the usage row's transaction and before the
last event or the JSON answer goes out, so a client that retrieves it right after has it.
"""

from __future__ import annotations

from django.conf import settings
from django.http import JsonResponse, StreamingHttpResponse
from drf_spectacular.utils import OpenApiParameter, extend_schema

from engine_client import client as engine
from errors import EngineFailure, NotFound, ServiceError
from generation import services as generation
from generation.services import on_bookkeeping_thread
from inference.protocol import TERMINAL_EVENTS

from . import responses, responses_format, responses_store
from .errors import error_response
from .responses_serializers import (
    InputItemListSerializer,
    ResponseCreateRequestSerializer,
    ResponseDeletedSerializer,
    ResponseObjectSerializer,
)
from .views import ERRORS, LARGE_BODY_BYTES, AsyncAPIView, authenticate, parse_json, start

STREAM_NOTE = (
    "With stream=true the response is text/event-stream: `event: <type>` / `data: {event}` pairs, "
    "response.created, response.in_progress, the output items' events, then response.completed "
    "(response.incomplete when cut by max_output_tokens; an engine failure is an `error` event "
    "and response.failed)."
)
RESPONSE_ID = OpenApiParameter("response_id", str, OpenApiParameter.PATH)


class ResponsesView(AsyncAPIView):
    @extend_schema(
        operation_id="createResponse",
        request=ResponseCreateRequestSerializer,
        responses={200: ResponseObjectSerializer, **ERRORS},
        description=STREAM_NOTE,
    )
    async def post(self, request):
        try:
            rc = await on_bookkeeping_thread(
                admit, request, engine.aclient().lease(), large=len(request.body) > LARGE_BODY_BYTES
            )
        except ServiceError as error:
            return error_response(error)
        try:
            if rc.stream:
                return await _streaming_response(rc)
            return await _json_response(rc)
        except ServiceError as error:
            return _with_headers(error_response(error), rc.call.headers)


class ResponseDetailView(AsyncAPIView):
    @extend_schema(
        operation_id="getResponse",
        parameters=[RESPONSE_ID],
        responses={200: ResponseObjectSerializer, 401: ERRORS[401], 404: ERRORS[404]},
    )
    async def get(self, request, response_id: str):
        return await _stored(request, response_id, lambda stored: stored.body)

    @extend_schema(
        operation_id="deleteResponse",
        parameters=[RESPONSE_ID],
        responses={200: ResponseDeletedSerializer, 401: ERRORS[401], 404: ERRORS[404]},
    )
    async def delete(self, request, response_id: str):
        try:
            await on_bookkeeping_thread(delete, request, response_id)
        except ServiceError as error:
            return error_response(error)
        return JsonResponse({"id": response_id, "object": "response", "deleted": True})


class ResponseInputItemsView(AsyncAPIView):
    @extend_schema(
        operation_id="listInputItems",
        parameters=[RESPONSE_ID],
        responses={200: InputItemListSerializer, 401: ERRORS[401], 404: ERRORS[404]},
        description="The input items of a stored response (the earlier conversation's too), newest first.",
    )
    async def get(self, request, response_id: str):
        return await _stored(request, response_id, input_item_list)


# ---------------------------------------------------------------- bookkeeping-thread work


def admit(request, lease_id: str) -> responses.ResponseCall:
    key, plan = authenticate(request)
    rc = responses.build(body=parse_json(request), user=key.user, api_key=key, plan=plan)
    start(rc.call, plan, lease_id)
    return rc


def stored(request, response_id: str):
    key, _plan = authenticate(request)
    found = responses_store.stored_response(user=key.user, response_id=response_id)
    if found is None:
        raise _not_found(response_id)
    return found


def delete(request, response_id: str) -> None:
    key, _plan = authenticate(request)
    if not responses_store.delete_response(user=key.user, response_id=response_id):
        raise _not_found(response_id)


def _not_found(response_id: str) -> NotFound:
    return NotFound(f"Response with id '{response_id}' not found.", param="response_id", code="response_not_found")


def input_item_list(found) -> dict:
    items = list(reversed(found.conversation))
    return {
        "object": "list",
        "data": items,
        "first_id": items[0]["id"] if items else None,
        "last_id": items[-1]["id"] if items else None,
        "has_more": False,
    }


async def _stored(request, response_id: str, render):
    try:
        found = await on_bookkeeping_thread(stored, request, response_id)
    except ServiceError as error:
        return error_response(error)
    return JsonResponse(render(found))


# ---------------------------------------------------------------- following the generation


def _with_headers(response, headers: dict):
    for name, value in headers.items():
        response[name] = value
    return response


async def _finish(rc: responses.ResponseCall, body: dict | None) -> None:
    """The usage row, the quota settlement and (store, with a body) the stored response, once."""

    def save(gen) -> bool:
        if body is not None and rc.store and gen.user is not None:
            responses_store.store_response(user=gen.user, body=body, conversation=rc.conversation)
        return True

    await generation.afinish(rc.call.gen, save=save)


async def _events(rc: responses.ResponseCall):
    """The generation's events up to the terminal one. The caller finishes a generation that ended
    well (with its body to store); closing this early (an error, a disconnect) finishes it unsaved,
    after follow() has aborted the engine request and marked the disconnect."""
    follow = generation.follow(rc.call.gen, timeout=getattr(settings, "API_REQUEST_TIMEOUT", 3600))
    try:
        async for event in follow:
            yield event
    finally:
        await follow.aclose()
        if not rc.call.gen.finished:
            await _finish(rc, None)


async def _json_response(rc: responses.ResponseCall):
    events = _events(rc)
    try:
        async for event in events:
            if event["type"] in TERMINAL_EVENTS:
                break
        result = rc.call.gen.result
        if result.error:
            raise EngineFailure.from_event(result.error)
        body = responses_format.response_body(rc, result)
        await _finish(rc, body)
    finally:
        await events.aclose()
    return _with_headers(JsonResponse(body), rc.call.headers)


async def _streaming_response(rc: responses.ResponseCall):
    """The first engine event is awaited before answering, so early failures keep their HTTP status."""
    events = _events(rc)
    first = await anext(events)
    if first["type"] == "error":
        await events.aclose()
        raise EngineFailure.from_event(first)
    response = StreamingHttpResponse(_sse(rc, first, events), content_type="text/event-stream")
    response["Cache-Control"] = "no-cache"
    response["X-Accel-Buffering"] = "no"  # proxies must not buffer tokens
    return _with_headers(response, rc.call.headers)


async def _sse(rc: responses.ResponseCall, first: dict, events):
    writer = responses_format.EventWriter(rc)
    try:
        for chunk in writer.start():
            yield chunk
        event = first
        while event is not None:
            if event["type"] == "delta":
                for chunk in writer.delta(event):
                    yield chunk
            elif event["type"] == "finish":
                body, chunks = writer.finish(rc.call.gen.result)
                await _finish(rc, body)  # stored before the client reads response.completed
                for chunk in chunks:
                    yield chunk
                break
            elif event["type"] == "error":
                failure = EngineFailure.from_event(event)
                for chunk in writer.error(failure):
                    yield chunk
                break
            event = await anext(events, None)
    finally:
        await events.aclose()
