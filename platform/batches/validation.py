"""Validation of a batch input file, line by line, with every problem listed by its line number.

Pure functions (no database): the caller supplies what depends on the user and the deployment
(which models they may use, and the endpoint's own body checks).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from common import http_guards
from common.storable import holds_nul

SUPPORTED_URLS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings")
MAX_CUSTOM_ID_LENGTH = 512
MAX_ERRORS_REPORTED = 1000

# model name -> an error message, or None when the user may use it.
ModelCheck = Callable[[str], "str | None"]
# (url, body) -> (param, message) of the first problem, or None when the body is valid.
BodyCheck = Callable[[str, dict], "tuple[str | None, str] | None"]


@dataclass
class ParsedLine:
    line_number: int
    custom_id: str
    method: str
    url: str
    body: dict


@dataclass
class ValidationResult:
    lines: list[ParsedLine] = field(default_factory=list)
    errors: list[dict] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.errors and bool(self.lines)


def line_error(code: str, message: str, line: int | None, param: str | None = None) -> dict:
    return {"code": code, "message": message, "param": param, "line": line}


def validate_jsonl(
    content: bytes, endpoint: str, *, check_model: ModelCheck, check_body: BodyCheck, max_lines: int
) -> ValidationResult:
    """Parse and check every line; a result with any error means the batch must not run at all."""
    result = ValidationResult()
    try:
        text = content.decode("utf-8")
    except UnicodeDecodeError:
        result.errors.append(line_error("invalid_file", "The input file is not UTF-8 text.", None))
        return result
    seen: dict[str, int] = {}
    for number, raw in enumerate(text.splitlines(), start=1):
        if not raw.strip():
            continue
        if len(result.lines) + len(result.errors) >= max_lines:
            result.errors.append(
                line_error("too_many_lines", f"The input file has more than {max_lines} lines.", number)
            )
            break
        parsed, error = parse_line(raw, number, endpoint, check_model, check_body)
        if error is None and parsed.custom_id in seen:
            error = line_error(
                "duplicate_custom_id",
                f"custom_id {parsed.custom_id!r} also appears on line {seen[parsed.custom_id]}.",
                number,
                "custom_id",
            )
        if error is not None:
            if len(result.errors) < MAX_ERRORS_REPORTED:
                result.errors.append(error)
            continue
        seen[parsed.custom_id] = number
        result.lines.append(parsed)
    if not result.lines and not result.errors:
        result.errors.append(line_error("empty_file", "The input file has no requests.", None))
    return result


def parse_line(
    raw: str, number: int, endpoint: str, check_model: ModelCheck, check_body: BodyCheck
) -> tuple[ParsedLine | None, dict | None]:
    try:
        obj = http_guards.loads(raw)  # json.loads, refusing lone surrogates and deep nesting (ValueError)
    except ValueError as exc:
        return None, line_error("invalid_json_line", f"Line {number} is not valid JSON: {exc.msg}.", number)
    if not isinstance(obj, dict):
        return None, line_error("invalid_json_line", f"Line {number} is not a JSON object.", number)
    if holds_nul(obj):  # the line is kept in the database, whose text cannot hold it (common.storable)
        return None, line_error("invalid_json_line", f"Line {number} holds the NUL character (\\u0000).", number)
    error = check_envelope(obj, number, endpoint)
    if error is None:
        error = check_request(obj["url"], obj["body"], number, check_model, check_body)
    if error is not None:
        return None, error
    return ParsedLine(number, obj["custom_id"], obj["method"], obj["url"], obj["body"]), None


def check_envelope(obj: dict, number: int, endpoint: str) -> dict | None:
    """custom_id, method, url and body: present, well typed, and matching the batch's endpoint."""
    custom_id = obj.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        return line_error("invalid_custom_id", "custom_id must be a non-empty string.", number, "custom_id")
    if len(custom_id) > MAX_CUSTOM_ID_LENGTH:
        return line_error(
            "invalid_custom_id", f"custom_id is longer than {MAX_CUSTOM_ID_LENGTH} characters.", number, "custom_id"
        )
    if obj.get("method") != "POST":
        return line_error("invalid_method", 'method must be "POST".', number, "method")
    url = obj.get("url")
    if url not in SUPPORTED_URLS:
        return line_error("invalid_url", f"url must be one of {', '.join(SUPPORTED_URLS)}; got {url!r}.", number, "url")
    if url != endpoint:
        return line_error(
            "mismatched_endpoint", f"url {url!r} does not match the batch endpoint {endpoint!r}.", number, "url"
        )
    if not isinstance(obj.get("body"), dict):
        return line_error("invalid_body", "body must be a JSON object.", number, "body")
    return None


def check_request(url: str, body: dict, number: int, check_model: ModelCheck, check_body: BodyCheck) -> dict | None:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        return line_error("invalid_body", "body.model must be a non-empty string.", number, "body.model")
    if body.get("stream"):
        return line_error("invalid_body", "body.stream is not supported in a batch.", number, "body.stream")
    model_problem = check_model(model)
    if model_problem:
        return line_error("model_not_allowed", model_problem, number, "body.model")
    problem = check_body(url, body)
    if problem:
        param, message = problem
        return line_error("invalid_body", message, number, f"body.{param}" if param else "body")
    return None
