"""Refusals of the files and batches services; the /v1 views render them in OpenAI's error envelope."""
from __future__ import annotations


class BatchServiceError(Exception):
    status_code = 400
    error_type = "invalid_request_error"

    def __init__(self, message: str, *, code: str | None = None, param: str | None = None):
        super().__init__(message)
        self.message = message
        self.code = code
        self.param = param

    def as_error(self) -> dict:
        return {"error": {"message": self.message, "type": self.error_type, "param": self.param, "code": self.code}}


class InvalidRequest(BatchServiceError):
    pass


class NotFound(BatchServiceError):
    status_code = 404

    def __init__(self, message: str, *, param: str | None = None):
        super().__init__(message, code="not_found", param=param)


class Conflict(BatchServiceError):
    """The object is in a state that does not allow the operation (e.g. cancelling a finished batch)."""

    status_code = 409
