"""The /v1 rendering of errors.ServiceError: OpenAI's envelope {"error": {"message", "type", "param", "code"}}."""

from __future__ import annotations

import json
import logging

import redis
from django.core.exceptions import BadRequest, SuspiciousOperation
from django.http import JsonResponse
from rest_framework import exceptions as drf_exceptions
from rest_framework.views import exception_handler as drf_default_handler

from errors import TYPES, ServiceError

__all__ = ["TYPES", "envelope", "error_body", "error_response", "sse_error", "drf_exception_handler"]

log = logging.getLogger("tessera.api")


def envelope(message: str, type: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def error_body(error: ServiceError) -> dict:
    return envelope(error.message, error.type, error.param, error.code)


def error_response(error: ServiceError) -> JsonResponse:
    """The /v1 answer for any ServiceError: its status, the envelope and its headers (Retry-After...)."""
    response = JsonResponse(error_body(error), status=error.status)
    for name, value in error.headers.items():
        response[name] = value
    return response


def sse_error(error: ServiceError) -> bytes:
    """The error as one SSE event (an error after the stream has started: status is already 200)."""
    return f"data: {json.dumps(error_body(error))}\n\n".encode()


def drf_exception_handler(exc, context):
    """DRF views (files, batches) answer in the same envelope; unexpected errors become a 500 envelope."""
    if isinstance(exc, ServiceError):
        return _drf_response(error_body(exc), exc.status, exc.headers)
    if isinstance(exc, (SuspiciousOperation, BadRequest, redis.RedisError)):
        # Too many form fields / files (raised inside DRF's parsers), a body too big, Redis down:
        # re-raised to the /v1 middleware, which answers them for every view (400 / 413 / 503).
        return None
    response = drf_default_handler(exc, context)
    if response is None:
        log.exception("unhandled API error", exc_info=exc)
        return _drf_response(envelope("The server had an error while processing your request.", "server_error"), 500)
    return _drf_response(
        _drf_envelope(exc, response.data, response.status_code),
        response.status_code,
        {k: v for k, v in response.items()},
    )


def _drf_response(body, status, headers=None):
    from rest_framework.response import Response

    return Response(body, status=status, headers=headers)


def _drf_envelope(exc, data, status) -> dict:
    code = getattr(exc, "default_code", None)
    if isinstance(exc, drf_exceptions.ValidationError) and isinstance(data, dict) and data:
        param, problems = next(iter(data.items()))
        message = problems[0] if isinstance(problems, list) and problems else problems
        return envelope(
            f"{param}: {message}" if param != "non_field_errors" else str(message),
            TYPES[400],
            None if param == "non_field_errors" else param,
            "invalid_value",
        )
    if isinstance(exc, drf_exceptions.AuthenticationFailed) or isinstance(exc, drf_exceptions.NotAuthenticated):
        code = "invalid_api_key"
    detail = data.get("detail") if isinstance(data, dict) else data
    return envelope(str(detail), TYPES.get(status, "invalid_request_error"), None, code)
