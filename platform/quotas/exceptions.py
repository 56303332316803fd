"""Refusals raised by quotas.services.reserve; callers turn them into 429/400 responses or chat errors."""
from __future__ import annotations


class QuotaExceeded(Exception):
    """Over a rate or budget: answer 429 with Retry-After and these headers.

    code is "rate_limit_exceeded" (requests/minute, concurrency) or "insufficient_quota"
    (tokens/day, tokens/month); limit names which limit refused.
    """

    status_code = 429

    def __init__(self, code: str, message: str, retry_after: int, headers: dict[str, str], limit: str):
        super().__init__(message)
        self.code = code
        self.message = message
        self.retry_after = max(1, int(retry_after))
        self.headers = {**headers, "Retry-After": str(self.retry_after)}
        self.limit = limit

    @property
    def error_type(self) -> str:
        return "insufficient_quota" if self.code == "insufficient_quota" else "rate_limit_error"

    def as_error(self) -> dict:
        """The OpenAI error envelope for this refusal."""
        return {"error": {"message": self.message, "type": self.error_type, "param": None, "code": self.code}}


class PlanViolation(Exception):
    """The request itself is outside the plan (a model not allowed, max_tokens over the cap): not retryable."""

    def __init__(self, message: str, code: str, param: str, status_code: int = 400):
        super().__init__(message)
        self.message = message
        self.code = code
        self.param = param
        self.status_code = status_code

    def as_error(self) -> dict:
        return {"error": {"message": self.message, "type": "invalid_request_error", "param": self.param,
                          "code": self.code}}
