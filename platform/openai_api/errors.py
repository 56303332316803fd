"""OpenAI's error envelope for every /v1 response: {"error": {"message", "type", "param", "code"}}."""
from __future__ import annotations

import json
import logging

from django.http import JsonResponse
from rest_framework import exceptions as drf_exceptions
from rest_framework.views import exception_handler as drf_default_handler

log = logging.getLogger("tessera.api")

TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
         404: "not_found_error", 405: "invalid_request_error", 408: "timeout_error", 409: "conflict_error",
         413: "invalid_request_error", 422: "invalid_request_error", 429: "rate_limit_error",
         500: "server_error", 503: "service_unavailable"}


class OpenAIError(Exception):
    """Raise anywhere in the /v1 flow; the view answers with the envelope and this status."""

    def __init__(self, status: int, message: str, *, code: str | None = None, param: str | None = None,
                 type: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param
        self.type = type or TYPES.get(status, "invalid_request_error")
        self.headers = headers or {}

    def body(self) -> dict:
        return envelope(self.message, self.type, self.param, self.code)


def envelope(message: str, type: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def error_response(error: OpenAIError) -> JsonResponse:
    response = JsonResponse(error.body(), status=error.status)
    for name, value in error.headers.items():
        response[name] = value
    return response


def sse_error(error: OpenAIError) -> bytes:
    """The error as one SSE event (an error after the stream has started: status is already 200)."""
    return f"data: {json.dumps(error.body())}\n\n".encode()


def drf_exception_handler(exc, context):
    """DRF views (files, batches) answer in the same envelope; unexpected errors become a 500 envelope."""
    if isinstance(exc, OpenAIError):
        return _drf_response(exc.body(), exc.status, exc.headers)
    response = drf_default_handler(exc, context)
    if response is None:
        log.exception("unhandled API error", exc_info=exc)
        return _drf_response(envelope("The server had an error while processing your request.", "server_error"), 500)
    return _drf_response(_drf_envelope(exc, response.data, response.status_code), response.status_code,
                         {k: v for k, v in response.items()})


def _drf_response(body, status, headers=None):
    from rest_framework.response import Response

    return Response(body, status=status, headers=headers)


def _drf_envelope(exc, data, status) -> dict:
    code = getattr(exc, "default_code", None)
    if isinstance(exc, drf_exceptions.ValidationError) and isinstance(data, dict) and data:
        param, problems = next(iter(data.items()))
        message = problems[0] if isinstance(problems, list) and problems else problems
        return envelope(f"{param}: {message}" if param != "non_field_errors" else str(message),
                        TYPES[400], None if param == "non_field_errors" else param, "invalid_value")
    if isinstance(exc, drf_exceptions.AuthenticationFailed) or isinstance(exc, drf_exceptions.NotAuthenticated):
        code = "invalid_api_key"
    detail = data.get("detail") if isinstance(data, dict) else data
    return envelope(str(detail), TYPES.get(status, "invalid_request_error"), None, code)
