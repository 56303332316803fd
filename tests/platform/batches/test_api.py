"""/v1/files and /v1/batches through the official `openai` client (the API contract).

The client talks HTTP to the real Django application in-process (httpx's WSGI transport), so these
run inside pytest-django's test transaction; tests/platform/batches/test_batches_live.py drives the
same API against the web server, Celery and an engine worker.
"""

from __future__ import annotations

import httpx
import openai
import pytest
from batch_testing import chat_line, jsonl
from django.core.signals import request_finished, request_started
from django.core.wsgi import get_wsgi_application
from django.db import close_old_connections

pytestmark = pytest.mark.django_db

BASE = "http://testserver"


@pytest.fixture
def http():
    """As Django's test client does, requests keep the test transaction's connection: the handler's
    close_old_connections would drop it (on PostgreSQL; SQLite's in-memory test database never closes)."""
    request_started.disconnect(close_old_connections)
    request_finished.disconnect(close_old_connections)
    try:
        with httpx.Client(transport=httpx.WSGITransport(app=get_wsgi_application()), base_url=BASE) as client:
            yield client
    finally:
        request_started.connect(close_old_connections)
        request_finished.connect(close_old_connections)


def openai_client(http, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{BASE}/v1", api_key=key, max_retries=0, timeout=30, http_client=http)


@pytest.fixture
def client(http, api_key):
    return openai_client(http, api_key)


@pytest.fixture
def other_client(http, other_api_key):
    return openai_client(http, other_api_key)


CONTENT = jsonl([chat_line("one"), chat_line("two")])


def upload(client, content: bytes = CONTENT, name: str = "requests.jsonl"):
    return client.files.create(file=(name, content, "application/jsonl"), purpose="batch")


def test_files_create_list_retrieve_content_delete(client):
    created = upload(client)
    assert created.id.startswith("file-") and created.object == "file"
    assert (created.bytes, created.filename, created.purpose, created.status) == (
        len(CONTENT),
        "requests.jsonl",
        "batch",
        "processed",
    )
    assert created.created_at > 0 and created.expires_at > created.created_at
    assert [f.id for f in client.files.list()] == [created.id]
    assert client.files.retrieve(created.id).bytes == len(CONTENT)
    assert client.files.content(created.id).content == CONTENT
    deleted = client.files.delete(created.id)
    assert (deleted.id, deleted.object, deleted.deleted) == (created.id, "file", True)
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(created.id)


def test_files_list_filters_by_purpose_and_pages(client):
    ids = [upload(client, name=f"f{i}.jsonl").id for i in range(3)]
    page = client.files.list(limit=2)
    assert [f.id for f in page.data] == ids[::-1][:2] and page.has_more
    assert [f.id for f in client.files.list(limit=2)] == ids[::-1]  # the client follows `after` by itself
    assert [f.id for f in client.files.list(order="asc")] == ids
    assert list(client.files.list(purpose="batch_output")) == []


def test_upload_refusals_use_the_error_envelope(client, settings):
    with pytest.raises(openai.BadRequestError) as bad_purpose:
        client.files.create(file=("x.jsonl", CONTENT), purpose="fine-tune")
    assert bad_purpose.value.body["param"] == "purpose" and bad_purpose.value.body["type"] == "invalid_request_error"
    settings.BATCH_FILE_MAX_BYTES = 10
    with pytest.raises(openai.BadRequestError) as too_big:
        upload(client)
    assert too_big.value.body["code"] == "file_too_large"


def test_batch_create_retrieve_and_shape(client):
    file = upload(client)
    batch = client.batches.create(
        input_file_id=file.id, endpoint="/v1/chat/completions", completion_window="24h", metadata={"project": "demo"}
    )
    assert batch.id.startswith("batch_") and batch.object == "batch"
    assert (batch.status, batch.input_file_id, batch.endpoint, batch.completion_window) == (
        "validating",
        file.id,
        "/v1/chat/completions",
        "24h",
    )
    assert batch.metadata == {"project": "demo"}
    assert batch.request_counts.total == 0 and batch.output_file_id is None and batch.errors is None
    assert batch.expires_at - batch.created_at == 24 * 3600
    fetched = client.batches.retrieve(batch.id)
    assert fetched.id == batch.id and fetched.usage.total_tokens == 0


def test_batch_create_refusals(client):
    file = upload(client)
    cases = [
        dict(endpoint="/v1/moderations", completion_window="24h"),
        dict(endpoint="/v1/chat/completions", completion_window="7d"),
        dict(endpoint="/v1/chat/completions", completion_window="24h", metadata={"k": 1}),
    ]
    for kwargs in cases:
        with pytest.raises(openai.BadRequestError):
            client.batches.create(input_file_id=file.id, **kwargs)
    with pytest.raises(openai.NotFoundError):
        client.batches.create(input_file_id="file-missing", endpoint="/v1/chat/completions", completion_window="24h")


def test_batches_list_pages_with_after_cursor(client):
    file = upload(client)
    ids = [
        client.batches.create(input_file_id=file.id, endpoint="/v1/chat/completions", completion_window="24h").id
        for _ in range(3)
    ]
    first = client.batches.list(limit=2)
    assert [b.id for b in first.data] == ids[::-1][:2] and first.has_more
    second = client.batches.list(limit=2, after=first.data[-1].id)
    assert [b.id for b in second.data] == [ids[0]] and not second.has_more
    assert [b.id for b in client.batches.list(limit=2)] == ids[::-1]


def test_cancel_a_batch_still_validating(client):
    file = upload(client)
    batch = client.batches.create(input_file_id=file.id, endpoint="/v1/chat/completions", completion_window="24h")
    cancelled = client.batches.cancel(batch.id)
    assert cancelled.status == "cancelling" and cancelled.cancelling_at is not None
    assert client.batches.cancel(batch.id).status in ("cancelling", "cancelled")  # idempotent


def test_another_users_files_and_batches_are_404(client, other_client):
    file = upload(client)
    batch = client.batches.create(input_file_id=file.id, endpoint="/v1/chat/completions", completion_window="24h")
    for call in (
        lambda: other_client.files.retrieve(file.id),
        lambda: other_client.files.content(file.id),
        lambda: other_client.files.delete(file.id),
        lambda: other_client.batches.retrieve(batch.id),
        lambda: other_client.batches.cancel(batch.id),
        lambda: other_client.batches.create(
            input_file_id=file.id, endpoint="/v1/chat/completions", completion_window="24h"
        ),
    ):
        with pytest.raises(openai.NotFoundError) as missing:
            call()
        assert missing.value.body["type"] == "not_found_error" or missing.value.body["code"] == "not_found"
    assert list(other_client.files.list()) == [] and list(other_client.batches.list()) == []
    assert client.files.retrieve(file.id).id == file.id  # still there for its owner


def test_missing_or_bad_key_is_401(http):
    bad = openai_client(http, "tsk-wrong")
    with pytest.raises(openai.AuthenticationError) as denied:
        bad.files.list()
    assert denied.value.body["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        bad.batches.list()


def test_openapi_schema_documents_every_files_and_batches_route(http):
    from batches import urls

    schema = http.get("/v1/openapi.json").json()
    for pattern in urls.urlpatterns:
        route = str(pattern.pattern)
        if not route.startswith("v1/"):
            continue  # the web pages are not part of the API
        path = "/" + route.replace("<str:file_id>", "{file_id}").replace("<str:batch_id>", "{batch_id}")
        methods = {m for m in ("get", "post", "delete") if hasattr(pattern.callback.cls, m)}
        assert set(schema["paths"][path]) >= methods, path
    batch = schema["paths"]["/v1/batches/{batch_id}"]["get"]["responses"]["200"]["content"]["application/json"]
    assert batch["schema"]["$ref"].endswith("/Batch")
