"""/v1 paths never answer with Django's HTML pages: unknown routes and crashes get the envelope too.

Also counts /v1 requests by endpoint and status for /metrics. Async-capable, so the streaming
views stay on the event loop.
"""
from __future__ import annotations

import logging
import time

from asgiref.sync import iscoroutinefunction, markcoroutinefunction
from django.http import JsonResponse

from . import metrics
from .errors import envelope

log = logging.getLogger("tessera.api")
API_PREFIX = "/v1/"


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
        if not request.path.startswith(API_PREFIX):
            return self.get_response(request)
        started = time.perf_counter()
        response = self.get_response(request)
        response = self.fix(request, response)
        metrics.count_request(request, response.status_code, time.perf_counter() - started)
        return response

    async def __acall__(self, request):
        if not request.path.startswith(API_PREFIX):
            return await self.get_response(request)
        started = time.perf_counter()
        response = await self.get_response(request)
        response = self.fix(request, response)
        await metrics.acount_request(request, response.status_code, time.perf_counter() - started)
        return response

    def fix(self, request, response):
        """Replace Django's HTML 404/405/500 bodies under /v1 with the envelope."""
        content_type = response.get("Content-Type", "")
        if response.status_code < 400 or content_type.startswith("application/json") or response.streaming:
            return response
        messages = {404: f"Unknown request URL: {request.method} {request.path}.",
                    405: f"Method {request.method} is not allowed on {request.path}.",
                    500: "The server had an error while processing your request."}
        message = messages.get(response.status_code, response.reason_phrase)
        kind = {404: "invalid_request_error", 405: "invalid_request_error"}.get(response.status_code, "server_error")
        code = {404: "unknown_url", 405: "method_not_allowed"}.get(response.status_code)
        fixed = JsonResponse(envelope(message, kind, None, code), status=response.status_code)
        return fixed

    def process_exception(self, request, exception):
        if not request.path.startswith(API_PREFIX):
            return None
        log.exception("unhandled error on %s", request.path, exc_info=exception)
        return JsonResponse(envelope("The server had an error while processing your request.", "server_error"),
                            status=500)
