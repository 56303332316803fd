"""The one rule both schemathesis runs assert on every response."""

from __future__ import annotations

from tests.platform.security.asgi_calls import is_envelope


def check_response(case, response, expected_5xx: frozenset = frozenset()) -> None:
    """No 5xx (but the (status, code) pairs in expected_5xx), and every error in the OpenAI envelope."""
    status = response.status_code
    if case.path == "/health" and status == 503:
        assert response.json()["status"] == "unavailable"  # the documented health body, not an error
        return
    if status < 400:
        return
    content_type = response.headers.get("content-type", [""])[0]
    assert content_type.startswith("application/json"), (status, case.method, case.path, response.text[:300])
    body = response.json()
    assert is_envelope(body), (case.method, case.path, body)
    if status >= 500:
        assert (status, body["error"]["code"]) in expected_5xx, (case.method, case.path, case.body, body)
