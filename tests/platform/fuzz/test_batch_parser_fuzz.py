"""Property-based fuzzing of the JSONL batch parser (batches/validation.py): whatever the file holds, it
never raises, and every non-blank line is accounted for exactly once (accepted with a unique custom_id,
or reported with its line number), so no accepted line can be lost or doubled later.
"""

from __future__ import annotations

import json

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from batches.validation import MAX_ERRORS_REPORTED, validate_jsonl
from common import http_guards

URL = "/v1/chat/completions"
MAX_LINES = 50
FUZZ = settings(max_examples=150, derandomize=True, deadline=None, suppress_health_check=[HealthCheck.too_slow])

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=12,
)


def _request(custom_id, body) -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": URL, "body": body})


valid_lines = st.builds(
    lambda cid, content: _request(cid, {"model": "m", "messages": [{"role": "user", "content": content}]}),
    st.text(min_size=1, max_size=6),
    st.text(max_size=20),
)
hostile_lines = st.sampled_from(
    [
        "{" * 100_000,
        _request("deep", {"model": "m", "x": "PLACEHOLDER"}).replace('"PLACEHOLDER"', "[" * 5000 + "]" * 5000),
        _request("\\ud800", {"model": "m"}).replace("\\\\ud800", "\\ud800"),
        '{"custom_id": "s", "method": "POST", "url": "/v1/chat/completions", "body": {"model": "\\udfff"}}',
        _request("a", {"model": "m", "stream": True}),
        _request("", {"model": "m"}),
        _request("x" * 600, {"model": "m"}),
        '{"custom_id": 1}',
        "[]",
        "null",
        "\x00",
        "\u2028",
        "   ",
        '{"custom_id": "t", "method": "GET"}',
    ]
)
any_line = valid_lines | hostile_lines | st.text(max_size=40) | st.builds(json.dumps, json_values)


def _validate(content: bytes):
    return validate_jsonl(
        content, URL, check_model=lambda model: None, check_body=lambda url, body: None, max_lines=MAX_LINES
    )


def _non_blank_lines(content: bytes) -> list[int]:
    return [n for n, raw in enumerate(content.decode("utf-8").splitlines(), start=1) if raw.strip()]


@FUZZ
@given(st.binary(max_size=400))
def test_arbitrary_bytes_never_raise(content):
    result = _validate(content)
    assert result.ok or result.errors


@FUZZ
@given(st.lists(any_line, max_size=12))
def test_every_line_is_accepted_once_or_reported(lines):
    content = "\n".join(lines).encode("utf-8", "surrogatepass")
    result = _validate(content)
    try:
        numbers = _non_blank_lines(content)
    except UnicodeDecodeError:
        assert [e["code"] for e in result.errors] == ["invalid_file"] and not result.lines
        return
    accepted = [line.line_number for line in result.lines]
    reported = [e["line"] for e in result.errors if e["line"] is not None]
    assert len(set(accepted)) == len(accepted) and not set(accepted) & set(reported)
    if len(numbers) <= MAX_LINES and len(reported) < MAX_ERRORS_REPORTED:
        assert sorted(accepted + reported) == numbers
    assert len({line.custom_id for line in result.lines}) == len(result.lines)
    for line in result.lines:
        assert line.url == URL and line.method == "POST" and isinstance(line.body.get("model"), str)
        assert not line.body.get("stream")
        # What was accepted can be written to the output file later (UTF-8, as JSON).
        json.dumps({"custom_id": line.custom_id, "body": line.body}, ensure_ascii=False).encode("utf-8")
    for error in result.errors:
        assert error["code"] and error["message"]


def test_hostile_lines_are_reported_not_raised():
    deep = _request("deep", {"model": "m", "x": 0}).replace("0}", "[" * 100_000 + "]" * 100_000 + "}")
    surrogate = _request("id", {"model": "m", "messages": [{"role": "user", "content": "\\ud800"}]})
    result = _validate(f"{deep}\n{surrogate.replace(chr(92) * 2, chr(92))}\n{_request('ok', {'model': 'm'})}".encode())
    assert [line.custom_id for line in result.lines] == ["ok"]
    assert [(e["line"], e["code"]) for e in result.errors] == [(1, "invalid_json_line"), (2, "invalid_json_line")]
    assert f"{http_guards.MAX_JSON_DEPTH} levels" in result.errors[0]["message"]
    assert "surrogate" in result.errors[1]["message"]
