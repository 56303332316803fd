"""The one error hierarchy of the platform: every refusal or failure a caller sees is a ServiceError.

Services raise these; front doors render them once each: openai_api.errors.error_response (the
OpenAI envelope on /v1, also what the middleware calls), chat.consumers.error_frame (the
playground websocket), and the batch runner stores the /v1 envelope as a line's error.
No Django here, so every layer (quotas, chat, batches, the generation service) may import it.
"""

from __future__ import annotations

# OpenAI's error "type" for each status; a subclass may name its own (insufficient_quota).
TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "timeout_error",
    409: "conflict_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    499: "invalid_request_error",
    500: "server_error",
    503: "service_unavailable",
    504: "timeout_error",
}


class ServiceError(Exception):
    """message (for people), code (for programs), param (the offending field), status, headers."""

    status = 400
    code = "invalid_request"

    def __init__(
        self,
        message: str,
        *,
        code: str | None = None,
        param: str | None = None,
        status: int | None = None,
        headers: dict[str, str] | None = None,
        type: str | None = None,
    ):
        super().__init__(message)
        self.message = message
        self.code = code or self.code
        self.param = param
        self.status = status or self.status
        self.headers = dict(headers or {})
        self._type = type

    @property
    def type(self) -> str:
        return self._type or TYPES.get(self.status, "invalid_request_error")


class InvalidRequest(ServiceError):
    code = "invalid_value"


class AuthenticationFailed(ServiceError):
    status = 401
    code = "invalid_api_key"


class NotFound(ServiceError):
    status = 404
    code = "not_found"


class Conflict(ServiceError):
    """The object's state does not allow the operation (cancelling a finished batch, a busy chat)."""

    status = 409
    code = "invalid_state"


class PlanViolation(ServiceError):
    """The request itself is outside the plan (a model not allowed, max_tokens over the cap): not retryable."""


class QuotaExceeded(ServiceError):
    """Over a rate or budget: 429 with Retry-After. code "rate_limit_exceeded" (requests/minute,
    concurrency) or "insufficient_quota" (tokens/day, tokens/month); limit names which one."""

    status = 429
    code = "rate_limit_exceeded"

    def __init__(self, message: str, *, code: str, retry_after: int, headers: dict[str, str], limit: str):
        self.retry_after = max(1, int(retry_after))
        self.limit = limit
        super().__init__(
            message,
            code=code,
            headers={**headers, "Retry-After": str(self.retry_after)},
            type="insufficient_quota" if code == "insufficient_quota" else None,
        )


class EngineUnavailable(ServiceError):
    """No live engine worker can take the request."""

    status = 503
    code = "engine_unavailable"


# An engine stream's error event -> (status, the code callers see). The protocol's codes are
# docs/protocol.md's; "no_worker" is the same refusal as EngineUnavailable up front.
ENGINE_ERRORS = {
    "invalid_request": (400, "invalid_request"),
    "no_worker": (503, "engine_unavailable"),
    "worker_lost": (503, "worker_lost"),
    "worker_shutdown": (503, "worker_shutdown"),
    "expired": (503, "expired"),
    "timeout": (504, "timeout"),
    "engine_error": (500, "engine_error"),
}


class EngineFailure(ServiceError):
    """A request the engine (or the client's liveness rule) ended with an error event."""

    status = 500
    code = "engine_error"

    @classmethod
    def from_event(cls, event: dict) -> "EngineFailure":
        status, code = ENGINE_ERRORS.get(event.get("code") or "", (500, event.get("code") or "engine_error"))
        return cls(event.get("message") or code, code=code, status=status, param=event.get("param"))
