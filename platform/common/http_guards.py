"""Hostile-input rules for the machine-facing paths (/v1/..., /health, /metrics), before any view runs.

Every /v1 endpoint parses its body its own way (the lean generation views with json.loads, the
files and batches views with DRF's parsers); the byte-level rules they all need live here once:
a size limit (413), valid Unicode (no lone UTF-16 surrogates, which json.loads accepts and every
encoder later refuses) and a nesting limit (json.loads raises RecursionError past ~1,000 levels,
and validators recurse too). Malformed JSON is left to the views, which say where it broke.
loads() is the same JSON rule for JSON that arrives inside a file (batch input lines).
"""

from __future__ import annotations

import json
import re

from django.conf import settings
from django.core.exceptions import RequestDataTooBig

MACHINE_PATHS = ("/health", "/metrics", "/tokenize", "/detokenize", "/tokenizer_info")
API_PREFIX = "/v1/"
MAX_JSON_DEPTH = 64  # tool schemas and content parts nest a handful of levels; 64 is ample
KNOWN_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})
_SURROGATE = re.compile("[\ud800-\udfff]")
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


class BadInput(Exception):
    """A request refused before its view: answered with this status in the OpenAI envelope."""

    def __init__(self, status: int, message: str, code: str):
        super().__init__(message)
        self.status, self.message, self.code = status, message, code


def is_machine_path(path: str) -> bool:
    """The paths served by the API handler and answered in the envelope, never with an HTML page."""
    return path.startswith(API_PREFIX) or path in MACHINE_PATHS


BODY_TOO_LARGE = "tessera.body_too_large"  # set in the ASGI scope by capped_receive()
MULTIPART_OVERHEAD = 1 << 20  # form fields and part headers around an uploaded file


def body_limit(scope) -> int | None:
    """The most bytes a request may send: the upload limit for files, Django's for everything else."""
    if _scope_content_type(scope) == "multipart/form-data":
        from batches import conf

        return conf.get("BATCH_FILE_MAX_BYTES") + MULTIPART_OVERHEAD
    return settings.DATA_UPLOAD_MAX_MEMORY_SIZE


def capped_receive(scope, receive):
    """receive() that stops taking the body past body_limit(): the rest is never read into memory or onto
    disk (Django would spool all of it first), and scope[BODY_TOO_LARGE] marks the request for a 413."""
    limit = body_limit(scope)
    if limit is None:
        return receive
    declared = _declared_length(scope)
    received = 0

    async def capped():
        nonlocal received
        if declared > limit:
            scope[BODY_TOO_LARGE] = True
        if scope.get(BODY_TOO_LARGE):
            return {"type": "http.request", "body": b"", "more_body": False}
        message = await receive()
        if message["type"] == "http.request":
            received += len(message.get("body", b""))
            if received > limit:
                scope[BODY_TOO_LARGE] = True
                return {"type": "http.request", "body": b"", "more_body": False}
        return message

    return capped


def _declared_length(scope) -> int:
    for name, value in scope.get("headers", []):
        if name.lower() == b"content-length":
            try:
                return int(value)
            except ValueError:
                return 0
    return 0


def _scope_content_type(scope) -> str:
    for name, value in scope.get("headers", []):
        if name.lower() == b"content-type":
            return value.decode("latin1").split(";")[0].strip().lower()
    return ""


def check_body(request) -> None:
    """Raise BadInput when the body is too large or is JSON that no view could use safely."""
    if _content_type(request) == "multipart/form-data":
        return  # uploads stream to files; their size limit is the batch file limit, not this one
    body = read_body(request)
    if body and _content_type(request) != "application/x-www-form-urlencoded":
        check_json(body)


def read_body(request) -> bytes:
    """request.body, or 413 when it is over DATA_UPLOAD_MAX_MEMORY_SIZE (also for chunked bodies)."""
    limit = settings.DATA_UPLOAD_MAX_MEMORY_SIZE
    try:
        body = request.body
    except RequestDataTooBig:
        body = None
    if body is None or (limit is not None and len(body) > limit):
        raise BadInput(413, f"The request body is larger than the limit of {limit} bytes.", "request_too_large")
    return body


def check_json(body: bytes) -> None:
    try:
        loads(body)
    except UnsafeJSON as refused:
        raise BadInput(400, refused.msg, refused.code) from None
    except ValueError:
        return  # malformed JSON: the view answers with its own 400, naming the position


class UnsafeJSON(ValueError):
    """Valid JSON syntax that no consumer can use safely; .msg as on json.JSONDecodeError."""

    def __init__(self, msg: str, code: str):
        super().__init__(msg)
        self.msg, self.code = msg, code


def loads(text: str | bytes):
    """json.loads that also refuses lone surrogates and nesting past MAX_JSON_DEPTH (UnsafeJSON)."""
    try:
        value = json.loads(text)
    except RecursionError:
        raise _too_deep() from None
    if _may_be_unsafe(text):
        _check_tree(value)
    return value


def _may_be_unsafe(text: str | bytes) -> bool:
    """Cheap scans of the raw text that rule out the tree walk for almost every body (a walk of a
    large prompt blocks the event loop: docs/architecture.md): a lone surrogate needs a \\uD800-\\uDFFF
    escape (or, in a str, the character itself), and depth past the limit needs more brackets than the limit."""
    raw = text.encode("utf-8", "surrogatepass") if isinstance(text, str) else text
    if raw.count(b"[") + raw.count(b"{") > MAX_JSON_DEPTH:
        return True
    if b"\\u" in raw and _SURROGATE_ESCAPE.search(raw):
        return True
    return isinstance(text, str) and _SURROGATE.search(text) is not None


def _check_tree(value) -> None:
    """Depth and lone surrogates (in keys and values), without recursion."""
    pending = [(value, 1)]
    while pending:
        item, depth = pending.pop()
        if isinstance(item, str):
            if _SURROGATE.search(item):
                raise UnsafeJSON(
                    "The JSON contains a lone UTF-16 surrogate (such as \\ud800), which is not valid Unicode.",
                    "invalid_unicode",
                )
        elif isinstance(item, (dict, list)):
            if depth > MAX_JSON_DEPTH:
                raise _too_deep()
            children = [*item.keys(), *item.values()] if isinstance(item, dict) else item
            pending.extend((child, depth + 1) for child in children)


def _too_deep() -> UnsafeJSON:
    return UnsafeJSON(f"The JSON is nested more than {MAX_JSON_DEPTH} levels deep.", "json_too_deep")


def _content_type(request) -> str:
    return (request.META.get("CONTENT_TYPE") or "").split(";")[0].strip().lower()


def metric_method(method: str) -> str:
    """A bounded label for /metrics: the standard methods as they are, anything else "other"."""
    return method if method in KNOWN_METHODS else "other"
