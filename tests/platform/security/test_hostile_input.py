"""Bad input on the machine-facing paths gets a 4xx in the OpenAI envelope, never a 500 (issue 21, item 3).

Every request goes through the real ASGI application (the lean API handler the web server serves /v1 with).
"""

from __future__ import annotations

import json

import pytest
from django.conf import settings
from django.contrib.auth.models import User
from django.urls import URLPattern, URLResolver, get_resolver

from accounts.services import create_api_key
from common import http_guards
from tests.platform.security.asgi_calls import call, is_envelope, no_engine_workers, raw_call

pytestmark = pytest.mark.django_db(transaction=True)
JSON_ENDPOINTS = ["/v1/chat/completions", "/v1/completions", "/v1/batches", "/v1/files"]


@pytest.fixture
def auth():
    no_engine_workers()  # nothing gets generated: a request past every input check answers 503
    user = User.objects.create_user("mallory", password="pw-long-enough")
    return {"Authorization": f"Bearer {create_api_key(user)[1]}"}


def _refused(response, status: int, code: str):
    assert response.status_code == status, response.content[:300]
    assert response.headers["content-type"].startswith("application/json")
    body = response.json()
    assert is_envelope(body) and body["error"]["code"] == code, body
    return body


def _chat(content: str) -> bytes:
    return json.dumps({"model": "tessera-demo", "messages": [{"role": "user", "content": content}]}).encode()


@pytest.mark.parametrize("path", JSON_ENDPOINTS)
def test_a_body_over_the_upload_limit_is_413(auth, path):
    body = _chat("a" * (settings.DATA_UPLOAD_MAX_MEMORY_SIZE + 1))
    response = call("POST", path, content=body, headers={**auth, "content-type": "application/json"})
    _refused(response, 413, "request_too_large")


def test_a_chunked_body_without_content_length_is_held_to_the_same_limit_and_not_read_further(auth):
    chunk = b"a" * (1 << 20)
    count = settings.DATA_UPLOAD_MAX_MEMORY_SIZE // len(chunk) + 3
    headers = [(b"authorization", auth["Authorization"].encode()), (b"content-type", b"application/json")]
    unread = []
    status, _headers, body = raw_call(
        {"method": "POST", "path": "/v1/chat/completions", "headers": headers}, [chunk] * count, unread
    )
    assert status == 413 and json.loads(body)["error"]["code"] == "request_too_large"
    assert len(unread) >= 2  # refused at the limit, not after spooling the whole body to disk


def test_a_declared_length_over_the_limit_is_413_before_any_body_is_read(auth):
    headers = [
        (b"authorization", auth["Authorization"].encode()),
        (b"content-type", b"application/json"),
        (b"content-length", str(10**10).encode()),
    ]
    unread = []
    status, _headers, body = raw_call(
        {"method": "POST", "path": "/v1/chat/completions", "headers": headers}, [b"{}"], unread
    )
    assert status == 413 and json.loads(body)["error"]["code"] == "request_too_large" and len(unread) == 1


def test_an_upload_may_exceed_the_json_limit_but_not_the_batch_file_limit(auth, settings):
    settings.BATCH_FILE_MAX_BYTES = 1000
    chunk = b"a" * (1 << 20)
    headers = [
        (b"authorization", auth["Authorization"].encode()),
        (b"content-type", b"multipart/form-data; boundary=xx"),
    ]
    unread = []
    status, _headers, body = raw_call(
        {"method": "POST", "path": "/v1/files", "headers": headers},
        [chunk] * (http_guards.MULTIPART_OVERHEAD // len(chunk) + 3),
        unread,
    )
    assert status == 413 and json.loads(body)["error"]["code"] == "request_too_large" and unread
    settings.BATCH_FILE_MAX_BYTES = 50 * 1024 * 1024
    line = (
        json.dumps(
            {
                "custom_id": "a",
                "method": "POST",
                "url": "/v1/chat/completions",
                "body": {"model": "m", "messages": [{"role": "user", "content": "x" * 1000}]},
            }
        )
        + "\n"
    )
    big = (line * (settings.DATA_UPLOAD_MAX_MEMORY_SIZE // len(line) + 10)).encode()  # over the JSON limit
    uploaded = call("POST", "/v1/files", headers=auth, files={"file": ("big.jsonl", big)}, data={"purpose": "batch"})
    assert uploaded.status_code == 200 and uploaded.json()["bytes"] == len(big)


@pytest.mark.parametrize("path", JSON_ENDPOINTS)
@pytest.mark.parametrize("raw", [rb'"\ud800"', rb'"x\udfffy"', rb'"\ud800\u0041"'])
def test_a_lone_surrogate_is_400(auth, path, raw):
    body = (
        b'{"model": "tessera-demo", "metadata": {"k": '
        + raw
        + b'}, "messages": [{"role": "user", "content": '
        + raw
        + b'}], "prompt": '
        + raw
        + b"}"
    )
    _refused(
        call("POST", path, content=body, headers={**auth, "content-type": "application/json"}), 400, "invalid_unicode"
    )


def test_a_lone_surrogate_in_a_key_is_400(auth):
    body = b'{"model": "tessera-demo", "\\udc00": 1, "messages": [{"role": "user", "content": "hi"}]}'
    _refused(call("POST", "/v1/chat/completions", content=body, headers=auth), 400, "invalid_unicode")


def test_a_surrogate_pair_is_valid_unicode_and_passes(auth):
    response = call("POST", "/v1/chat/completions", content=_chat("\U0001f600"), headers=auth)
    # Past every input check, to the view: no engine worker (503), or a model name it does not serve (404).
    assert response.json()["error"]["code"] in ("engine_unavailable", "model_not_found")


@pytest.mark.parametrize("path", JSON_ENDPOINTS)
def test_100k_deep_json_is_400(auth, path):
    body = b"[" * 100_000 + b"]" * 100_000
    _refused(
        call("POST", path, content=body, headers={**auth, "content-type": "application/json"}), 400, "json_too_deep"
    )


def test_nesting_just_past_the_limit_is_400_and_at_the_limit_reaches_the_view(auth):
    def nested(levels):  # the body object itself is level 1
        return '{"model": "tessera-demo", "metadata": ' + "[" * (levels - 1) + "]" * (levels - 1) + "}"

    headers = {**auth, "content-type": "application/json"}
    deep = call("POST", "/v1/batches", content=nested(http_guards.MAX_JSON_DEPTH + 1), headers=headers)
    _refused(deep, 400, "json_too_deep")
    at_limit = call("POST", "/v1/batches", content=nested(http_guards.MAX_JSON_DEPTH), headers=headers)
    assert at_limit.status_code == 400 and at_limit.json()["error"]["code"] != "json_too_deep"


def test_malformed_json_is_still_answered_by_the_view(auth):
    _refused(call("POST", "/v1/chat/completions", content=b'{"model": ', headers=auth), 400, "invalid_json")


def _machine_routes(patterns=None, prefix=""):
    """Every URL pattern the API handler serves, with each converter filled in."""
    for entry in patterns if patterns is not None else get_resolver().url_patterns:
        if isinstance(entry, URLResolver):
            yield from _machine_routes(entry.url_patterns, prefix + str(entry.pattern))
        elif isinstance(entry, URLPattern):
            route = "/" + prefix + str(entry.pattern)
            if http_guards.is_machine_path(route):
                for name in entry.pattern.converters:
                    route = route.replace(f"<path:{name}>", "x").replace(f"<str:{name}>", "x")
                yield route


def test_the_route_list_covers_the_api():
    routes = set(_machine_routes())
    assert {"/v1/chat/completions", "/v1/files/x/content", "/v1/batches/x/cancel", "/health", "/metrics"} <= routes


@pytest.mark.parametrize("route", sorted(_machine_routes()))
def test_options_answers_every_machine_route_with_its_methods(route):
    response = call("OPTIONS", route)
    assert response.status_code == 200, response.content[:300]
    allowed = {m.strip() for m in response.headers["allow"].split(",")}
    assert "OPTIONS" in allowed and allowed & {"GET", "POST"}


def test_options_names_the_views_own_methods():
    assert set(call("OPTIONS", "/v1/files/x").headers["allow"].replace(" ", "").split(",")) == {
        "GET",
        "DELETE",
        "OPTIONS",
    }


def test_options_on_an_unknown_route_is_a_404_envelope():
    _refused(call("OPTIONS", "/v1/nothing-here"), 404, "unknown_url")


@pytest.mark.parametrize(
    "request_kwargs",
    [
        {"content": b"", "headers": {"content-type": "multipart/form-data"}},
        {"content": b"", "headers": {"content-type": "multipart/form-data; boundary=xx"}},
        {"content": b"--xx--\r\n", "headers": {"content-type": "multipart/form-data; boundary=xx"}},
        {"content": b"garbage", "headers": {"content-type": "multipart/form-data; boundary=xx"}},
        {"files": {"file": ("batch.jsonl", b"")}, "data": {"purpose": "batch"}},
        {"files": {"file": ("", b"")}, "data": {"purpose": "batch"}},
    ],
)
def test_an_empty_multipart_upload_is_400_with_the_envelope(auth, request_kwargs):
    headers = {**auth, **request_kwargs.pop("headers", {})}
    response = call("POST", "/v1/files", headers=headers, **request_kwargs)
    assert response.status_code == 400 and is_envelope(response.json()), response.content[:300]


def test_a_query_string_that_is_not_utf8_is_400_with_the_envelope():
    status, headers, body = raw_call({"path": "/v1/models", "query_string": b"after=\xff\xfe"}, [])
    assert status == 400 and headers["content-type"].startswith("application/json")
    assert is_envelope(json.loads(body)) and json.loads(body)["error"]["code"] == "bad_request"


def test_an_unknown_method_name_is_405_with_the_envelope(auth):
    _refused(call("BREW", "/v1/models", headers=auth), 405, "method_not_allowed")


@pytest.mark.parametrize(
    "text, code",
    [
        ('"\\ud800"', "invalid_unicode"),
        ('{"k": ["\\uDFFF"]}', "invalid_unicode"),
        ('["\ud800"]', "invalid_unicode"),
        ("[" * 65 + "]" * 65, "json_too_deep"),
        ("[" * 100_000 + "]" * 100_000, "json_too_deep"),
        ('{"\\udc00": 1}', "invalid_unicode"),
        ('"\\\\ud800"', None),
        ('"\\ud83d\\ude00"', None),
        ("[" * 64 + "]" * 64, None),
        ('{"a": "' + "[" * 100 + '"}', None),
    ],
)
def test_loads_refuses_exactly_lone_surrogates_and_deep_nesting(text, code):
    if code is None:
        assert http_guards.loads(text) == json.loads(text)
    else:
        with pytest.raises(http_guards.UnsafeJSON) as refused:
            http_guards.loads(text)
        assert refused.value.code == code


@pytest.mark.parametrize("text", ['"\\ud800"', '{"k": ["\\uDFFF"]}', "[" * 65 + "]" * 65])
def test_loads_refuses_the_same_in_bytes(text):
    with pytest.raises(http_guards.UnsafeJSON):
        http_guards.loads(text.encode())


@pytest.mark.parametrize(
    "request_kwargs",
    [
        {"data": {f"f{i}": "x" for i in range(1200)}, "files": {"file": ("a.jsonl", b"{}")}},
        {"files": [("file", (f"a{i}.jsonl", b"{}")) for i in range(120)]},
        {
            "content": b"&".join(b"a%d=1" % i for i in range(1200)),
            "headers": {"content-type": "application/x-www-form-urlencoded"},
        },
    ],
    ids=["multipart-fields", "multipart-files", "form-fields"],
)
def test_too_many_form_fields_or_files_is_400(auth, request_kwargs):
    headers = {**auth, **request_kwargs.pop("headers", {})}
    response = call("POST", "/v1/files", headers=headers, **request_kwargs)
    assert response.status_code == 400 and is_envelope(response.json()), response.text[:300]
