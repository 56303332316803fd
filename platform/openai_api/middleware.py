"""The machine-facing paths (/v1/..., /health, /metrics) never answer with Django's HTML pages.

Before the view: OPTIONS is answered here for every route, and bodies that no view could use
safely (too large, lone surrogates, nested too deep: common/http_guards.py) are refused. After
it: unknown routes and crashes get the envelope too, a Redis outage is a 503, and /v1 requests
are counted by route, method and status for /metrics (a failed count is logged, never raised).
Async-capable, so the streaming views stay on the event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

import redis
from asgiref.sync import iscoroutinefunction, markcoroutinefunction
from django.core.exceptions import BadRequest, RequestDataTooBig, SuspiciousOperation
from django.http import HttpResponse, JsonResponse
from django.urls import Resolver404, resolve

from common import http_guards

from . import metrics
from .errors import TYPES, envelope

log = logging.getLogger("tessera.api")
API_PREFIX = http_guards.API_PREFIX
SERVER_ERROR = "The server had an error while processing your request."


class OpenAIErrorMiddleware:
    sync_capable = True
    async_capable = True

    def __init__(self, get_response):
        self.get_response = get_response
        self.is_async = iscoroutinefunction(get_response)
        if self.is_async:
            markcoroutinefunction(self)

    def __call__(self, request):
        if self.is_async:
            return self.__acall__(request)
        if not http_guards.is_machine_path(request.path):
            return self.get_response(request)
        started = time.perf_counter()
        response = self.before_view(request) or self.get_response(request)
        response = self.fix(request, response)
        if request.path.startswith(API_PREFIX):
            metrics.count_request(request, response.status_code, time.perf_counter() - started)
        return response

    async def __acall__(self, request):
        if not http_guards.is_machine_path(request.path):
            return await self.get_response(request)
        started = time.perf_counter()
        response = self.before_view(request) or await self.get_response(request)
        response = self.fix(request, response)
        if not request.path.startswith(API_PREFIX):
            return response
        seconds = time.perf_counter() - started
        if response.streaming and response.is_async:  # the count's Redis round trip must not delay the first token
            response.streaming_content = counted_at_end(
                response.streaming_content, request, response.status_code, seconds
            )
        else:
            await metrics.acount_request(request, response.status_code, seconds)
        return response

    def before_view(self, request):
        """An answer that needs no view (OPTIONS, a refused body), or None."""
        if request.method == "OPTIONS":
            return options_response(request)
        try:
            http_guards.check_body(request)
        except http_guards.BadInput as refused:
            return error_json(refused.status, refused.message, refused.code)
        return None

    def fix(self, request, response):
        """Replace Django's HTML (or empty) 4xx/5xx bodies with the envelope."""
        content_type = response.get("Content-Type", "")
        if response.status_code < 400 or content_type.startswith("application/json") or response.streaming:
            return response
        return status_envelope(response.status_code, request.method, request.path, response.reason_phrase)

    def process_exception(self, request, exception):
        if not http_guards.is_machine_path(request.path):
            return None
        if isinstance(exception, redis.RedisError):
            log.warning("Redis unavailable on %s: %s", request.path, exception)
            return error_json(
                503,
                "A backing service (Redis) is unavailable; try again shortly.",
                "redis_unavailable",
                "service_unavailable",
            )
        if isinstance(exception, RequestDataTooBig):
            return status_envelope(413, request.method, request.path)
        if isinstance(exception, (SuspiciousOperation, BadRequest)):
            return error_json(400, f"Bad request: {exception}", "bad_request")
        log.exception("unhandled error on %s", request.path, exc_info=exception)
        return error_json(500, SERVER_ERROR, None, "server_error")


async def counted_at_end(content, request, status: int, seconds: float):
    """A stream's chunks, then its count for /metrics (also when the client hung up: shielded)."""
    try:
        async with contextlib.aclosing(content) as chunks:
            async for chunk in chunks:
                yield chunk
    finally:
        await asyncio.shield(metrics.acount_request(request, status, seconds))


def options_response(request):
    """200 with the route's methods in Allow (as Django's View.options does); None for unknown routes."""
    try:
        view_class = getattr(resolve(request.path_info).func, "cls", None)
    except Resolver404:
        return None  # the resolver's 404, in the envelope
    if view_class is None:
        return None
    return HttpResponse(status=200, headers={"Allow": ", ".join(view_class().allowed_methods)})


def status_envelope(status: int, method: str, path: str, reason: str = "") -> JsonResponse:
    """The envelope for a bare status (Django's own 404/405/413/500, the ASGI handler's 400/413)."""
    known = {
        400: ("The request could not be read (its URL or headers are not valid).", "bad_request"),
        404: (f"Unknown request URL: {method} {path}.", "unknown_url"),
        405: (f"Method {method} is not allowed on {path}.", "method_not_allowed"),
        413: ("The request body is too large.", "request_too_large"),
        500: (SERVER_ERROR, None),
    }
    message, code = known.get(status, (reason or f"HTTP {status}", None))
    # OpenAI answers an unknown URL or method as an invalid request, not a missing object.
    return error_json(status, message, code, "invalid_request_error" if status in (404, 405) else None)


def error_json(status: int, message: str, code: str | None, kind: str | None = None) -> JsonResponse:
    kind = kind or TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return JsonResponse(envelope(message, kind, None, code), status=status)
