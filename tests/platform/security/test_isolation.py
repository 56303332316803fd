"""What already held under the issue 21 probe, kept under test: another user's objects are 404 everywhere
(pages, exports, /v1, websockets), every session POST needs its CSRF token, API keys are stored hashed,
and server-rendered pages escape what users wrote.
"""

from __future__ import annotations

import hashlib
import json
from datetime import timedelta

import pytest
from asgiref.sync import async_to_sync, sync_to_async
from channels.testing import WebsocketCommunicator
from django.conf import settings
from django.contrib.auth import get_user_model
from django.test import Client
from django.urls import URLPattern, URLResolver, get_resolver, reverse
from django.utils import timezone

from accounts.models import ApiKey
from accounts.services import create_api_key
from batches.models import Batch
from batches.services import upload_file
from chat.models import Conversation, Message
from common import http_guards
from tests.platform.security.asgi_calls import call, is_envelope
from usage.services import record_usage

pytestmark = pytest.mark.django_db(transaction=True)
PASSWORD = "a-Long-pass-123"
XSS = "<script>alert(1)</script><img src=x onerror=alert(2)>[link](javascript:alert(3))"


@pytest.fixture
def owner_objects():
    """alice's conversation (two messages), API key, usage record, uploaded file and batch."""
    alice = get_user_model().objects.create_user("alice", password=PASSWORD)
    conversation = Conversation.objects.create(user=alice, title="Title " + XSS, system_prompt="System " + XSS)
    question = Message.objects.create(conversation=conversation, role="user", content="Question " + XSS)
    answer = Message.objects.create(
        conversation=conversation, parent=question, role="assistant", content="**Answer** " + XSS
    )
    conversation.current_leaf = answer
    conversation.save()
    key, raw_key = create_api_key(alice, "alice's key")
    record = record_usage(
        user=alice,
        source="api",
        endpoint="/v1/chat/completions",
        model="tiny",
        request_id="req-alice",
        prompt_tokens=3,
        completion_tokens=4,
        latency_ms=5.0,
    )
    line = {
        "custom_id": "a",
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]},
    }
    file = upload_file(alice, content=(json.dumps(line) + "\n").encode(), filename=XSS + ".jsonl", purpose="batch")
    batch = Batch.objects.create(
        user=alice,
        input_file=file,
        input_file_public_id=file.public_id,
        endpoint="/v1/chat/completions",
        expires_at=timezone.now() + timedelta(days=1),
    )
    return {
        "user": alice,
        "conversation": conversation,
        "question": question,
        "answer": answer,
        "key": key,
        "raw_key": raw_key,
        "record": record,
        "file": file,
        "batch": batch,
    }


@pytest.fixture
def intruder():
    mallory = get_user_model().objects.create_user("mallory", password=PASSWORD)
    client = Client()
    client.force_login(mallory)
    return {"user": mallory, "client": client, "auth": {"Authorization": f"Bearer {create_api_key(mallory)[1]}"}}


def _page_urls(o) -> list[tuple[str, str]]:
    c, file, batch = o["conversation"].pk, o["file"].public_id, o["batch"].public_id
    return [
        ("get", reverse("chat:conversation", args=[c])),
        ("get", reverse("history:export_json", args=[c])),
        ("get", reverse("history:export_markdown", args=[c])),
        ("post", reverse("history:rename", args=[c])),
        ("post", reverse("history:delete", args=[c])),
        ("get", reverse("history:request_detail", args=[o["record"].pk])),
        ("post", reverse("accounts:api_key_revoke", args=[o["key"].pk])),
        ("get", reverse("batches:detail", args=[batch])),
        ("post", reverse("batches:cancel", args=[batch])),
        ("get", reverse("batches:download", args=[file])),
    ]


def _api_urls(o) -> list[tuple[str, str]]:
    file, batch = o["file"].public_id, o["batch"].public_id
    return [
        ("GET", f"/v1/files/{file}"),
        ("DELETE", f"/v1/files/{file}"),
        ("GET", f"/v1/files/{file}/content"),
        ("GET", f"/v1/batches/{batch}"),
        ("POST", f"/v1/batches/{batch}/cancel"),
    ]


def test_every_object_of_another_user_is_404_on_the_pages(owner_objects, intruder):
    for method, url in _page_urls(owner_objects):
        response = getattr(intruder["client"], method)(url, {"title": "pwned"} if method == "post" else None)
        assert response.status_code == 404, (url, response.status_code)
    _assert_untouched(owner_objects)


def test_every_object_of_another_user_is_404_on_v1(owner_objects, intruder):
    for method, url in _api_urls(owner_objects):
        response = call(method, url, headers=intruder["auth"])
        assert response.status_code == 404 and is_envelope(response.json()), url
    for listing in ("/v1/files", "/v1/batches"):
        assert call("GET", listing, headers=intruder["auth"]).json()["data"] == []
    _assert_untouched(owner_objects)


def test_the_owner_reaches_the_same_urls(owner_objects):
    """The 404s above are about ownership, not broken URLs."""
    client = Client()
    client.force_login(owner_objects["user"])
    for method, url in _page_urls(owner_objects):
        if method == "get":
            assert client.get(url).status_code == 200, url
    auth = {"Authorization": f"Bearer {owner_objects['raw_key']}"}
    for method, url in _api_urls(owner_objects):
        if method == "GET":
            assert call(method, url, headers=auth).status_code == 200, url


def _assert_untouched(o) -> None:
    conversation = Conversation.objects.get(pk=o["conversation"].pk)
    assert conversation.title == "Title " + XSS and conversation.messages.count() == 2
    assert ApiKey.objects.get(pk=o["key"].pk).revoked_at is None
    assert Batch.objects.get(pk=o["batch"].pk).status == o["batch"].status
    assert o["file"].__class__.objects.filter(pk=o["file"].pk).exists()


def _socket(user, path: str) -> WebsocketCommunicator:
    client = Client()
    client.force_login(user)
    cookie = f"sessionid={client.cookies[settings.SESSION_COOKIE_NAME].value}".encode()
    from tessera.asgi import application

    return WebsocketCommunicator(
        application, path, headers=[(b"origin", b"http://testserver"), (b"host", b"testserver"), (b"cookie", cookie)]
    )


def test_the_websockets_treat_another_users_ids_as_missing(owner_objects, intruder):
    o = owner_objects
    frames = [
        {"type": "send", "conversation_id": str(o["conversation"].pk), "content": "hi", "settings": {}},
        {"type": "edit", "message_id": o["question"].pk, "content": "changed", "settings": {}},
        {"type": "regenerate", "message_id": o["answer"].pk, "settings": {}},
        {"type": "resume", "message_id": o["answer"].pk},
        {"type": "stop", "message_id": o["answer"].pk},
        {"type": "select_branch", "conversation_id": str(o["conversation"].pk), "message_id": o["question"].pk},
    ]

    async def scenario():
        chat = await sync_to_async(_socket)(intruder["user"], "/ws/chat/")
        assert (await chat.connect(timeout=10))[0]
        await chat.receive_json_from(timeout=10)  # ready
        answers = []
        for frame in frames:
            await chat.send_json_to(frame)
            answers.append(await chat.receive_json_from(timeout=10))
        await chat.disconnect()
        progress = await sync_to_async(_socket)(intruder["user"], f"/ws/batches/{o['batch'].public_id}/")
        refused = await progress.connect(timeout=10)
        return answers, refused

    answers, refused = async_to_sync(scenario)()
    assert [a["type"] for a in answers] == ["error"] * len(frames), answers
    assert {a["code"] for a in answers} <= {"not_found", "not_streaming"}, answers
    assert refused == (False, 4404)
    assert Message.objects.filter(conversation=o["conversation"]).count() == 2
    assert Message.objects.get(pk=o["question"].pk).content == "Question " + XSS


def _browser_routes(patterns=None, prefix="/"):
    """Every non-API route of the URL conf (admin: its log-in page), converters filled with real ids."""
    for entry in patterns if patterns is not None else get_resolver().url_patterns:
        if isinstance(entry, URLResolver):
            if str(entry.pattern) != "admin/":
                yield from _browser_routes(entry.url_patterns, prefix + str(entry.pattern))
        elif isinstance(entry, URLPattern) and not http_guards.is_machine_path(prefix + str(entry.pattern)):
            yield prefix + str(entry.pattern)


def _filled(route: str, o) -> str:
    for name, value in {
        "<uuid:conversation_id>": o["conversation"].pk,
        "<int:record_id>": o["record"].pk,
        "<int:key_id>": o["key"].pk,
        "<str:batch_id>": o["batch"].public_id,
        "<str:file_id>": o["file"].public_id,
        "<int:user_id>": o["user"].pk,
    }.items():
        route = route.replace(name, str(value))
    assert "<" not in route, route
    return route


def test_every_session_post_needs_its_csrf_token(owner_objects):
    routes = sorted(set(_browser_routes())) + ["/admin/login/"]
    assert {"/accounts/login/", "/accounts/keys/", "/history/c/<uuid:conversation_id>/rename/"} <= set(routes)
    client = Client(enforce_csrf_checks=True)
    client.force_login(owner_objects["user"])
    for route in routes:
        url = _filled(route, owner_objects)
        assert client.post(url, {"title": "x", "name": "x"}).status_code == 403, url
    _assert_untouched(owner_objects)
    # With the token the same POST goes through: the 403s were the CSRF check, not the views.
    client.get(reverse("accounts:api_keys"))  # a page with a form sets the CSRF cookie
    token = client.cookies[settings.CSRF_COOKIE_NAME].value
    renamed = client.post(
        reverse("history:rename", args=[owner_objects["conversation"].pk]),
        {"title": "Renamed", "csrfmiddlewaretoken": token},
    )
    assert (
        renamed.status_code == 302 and Conversation.objects.get(pk=owner_objects["conversation"].pk).title == "Renamed"
    )


def test_api_keys_are_stored_only_as_a_hash(owner_objects):
    client = Client()
    client.force_login(owner_objects["user"])
    raw = client.post(reverse("accounts:api_keys"), {"name": "laptop"}).context["new_key"]
    key = ApiKey.objects.get(user=owner_objects["user"], name="laptop")
    assert key.hashed_key == hashlib.sha256(raw.encode()).hexdigest()
    stored = " ".join(str(getattr(key, field.attname)) for field in ApiKey._meta.fields)
    assert raw not in stored and raw[len(key.prefix) :] not in stored
    assert raw not in client.get(reverse("accounts:api_keys")).content.decode()


def _assert_escaped(html: str, where: str) -> None:
    assert "<script>alert(1)</script>" not in html and "<img src=x onerror" not in html, where
    assert 'href="javascript:' not in html, where


def test_server_rendered_pages_escape_what_users_wrote(owner_objects):
    o, client = owner_objects, Client()
    client.force_login(o["user"])
    pages = {
        "playground": reverse("chat:conversation", args=[o["conversation"].pk]),
        "history": reverse("history:conversations"),
        "batches": reverse("batches:list"),
        "batch": reverse("batches:detail", args=[o["batch"].public_id]),
    }
    for where, url in pages.items():
        response = client.get(url)
        assert response.status_code == 200 and response["Content-Type"].startswith("text/html"), where
        _assert_escaped(response.content.decode(), where)
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in client.get(pages["history"]).content.decode()
    for export in ("history:export_markdown", "history:export_json"):
        response = client.get(reverse(export, args=[o["conversation"].pk]))
        # Exports carry the text as written, but never as a page a browser would render or sniff.
        assert not response["Content-Type"].startswith("text/html") and response["X-Content-Type-Options"] == "nosniff"
        assert response["Content-Disposition"].startswith("attachment")
        assert (
            "Question " + XSS in response.content.decode()
            or json.dumps("Question " + XSS)[1:-1] in response.content.decode()
        )
