"""Playground and history pages over HTTP, and isolation: another user's objects answer 404."""

import json

import pytest
from django.urls import reverse

from chat import services
from chat.models import Conversation
from usage import services as usage_services

pytestmark = pytest.mark.django_db
PANEL = {"model": "tiny", "params": {"temperature": 0, "max_tokens": 8}}


@pytest.fixture
def conversation(user, chat_settings):
    reply = services.send_message(user, "Hello <script>alert(1)</script>", PANEL)
    reply.gen.result.add(
        {
            "type": "delta",
            "index": 0,
            "text": "**Hi** <img src=x onerror=alert(1)>",
            "token_ids": [1, 2, 3, 4],
            "finish_reason": "stop",
        }
    )
    reply.gen.result.add({"type": "finish", "finish_reasons": ["stop"], "usage": None, "metrics": {}})
    services.finish_reply(reply.message_id, reply.gen)
    return Conversation.objects.get(pk=reply.conversation_id)


@pytest.fixture
def api_record(user):
    return usage_services.record_usage(
        user=user,
        source="api",
        endpoint="/v1/chat/completions",
        model="tiny",
        request_id="req-abc",
        prompt_tokens=5,
        completion_tokens=7,
        latency_ms=42.0,
    )


def login(client, user):
    client.force_login(user)
    return client


def test_pages_require_login(client):
    for name in ("chat:playground", "history:conversations", "history:requests", "history:usage"):
        response = client.get(reverse(name))
        assert response.status_code == 302 and "/accounts/login/" in response["Location"]


def test_home_redirects(client, user):
    assert client.get("/")["Location"] == reverse("accounts:login")
    assert login(client, user).get("/")["Location"] == reverse("chat:playground")


def test_playground_embeds_the_branch_as_json_never_as_html(client, user, conversation):
    response = login(client, user).get(reverse("chat:conversation", args=[conversation.pk]))
    assert response.status_code == 200
    html = response.content.decode()
    assert "<script>alert(1)</script>" not in html and "<img src=x" not in html
    state = json.loads(html.split('id="playground-state" type="application/json">')[1].split("</script>")[0])
    assert [m["role"] for m in state["messages"]] == ["user", "assistant"]
    assert state["messages"][0]["content"] == "Hello <script>alert(1)</script>"  # the JS escapes it


def test_history_lists_searches_renames_and_deletes(client, user, conversation):
    login(client, user)
    page = client.get(reverse("history:conversations"), {"q": "hello"}).content.decode()
    assert str(conversation.pk) in page and "&lt;script&gt;" in page
    assert str(conversation.pk) not in client.get(reverse("history:conversations"), {"q": "zzz"}).content.decode()
    client.post(reverse("history:rename", args=[conversation.pk]), {"title": "Greetings"})
    conversation.refresh_from_db()
    assert conversation.title == "Greetings"
    client.post(reverse("history:delete", args=[conversation.pk]))
    assert not Conversation.objects.filter(pk=conversation.pk).exists()


def test_history_paginates(client, user, chat_settings):
    for i in range(25):
        Conversation.objects.create(user=user, title=f"c{i}")
    login(client, user)
    first = client.get(reverse("history:conversations")).context["page"]
    assert (len(first.object_list), first.paginator.num_pages) == (20, 2)
    assert first.object_list[0].title == "c24"  # newest first


def test_exports(client, user, conversation):
    login(client, user)
    as_json = client.get(reverse("history:export_json", args=[conversation.pk]))
    assert as_json["Content-Disposition"].startswith("attachment;")
    assert json.loads(as_json.content)["messages"][1]["content"].startswith("**Hi**")
    as_md = client.get(reverse("history:export_markdown", args=[conversation.pk]))
    assert as_md["Content-Type"].startswith("text/markdown") and b"## Assistant" in as_md.content


def test_request_list_filters_and_detail(client, user, conversation, api_record):
    login(client, user)
    everything = client.get(reverse("history:requests")).context["page"].object_list
    assert {r.source for r in everything} == {"api", "playground"}
    only_api = client.get(reverse("history:requests"), {"source": "api"}).context["page"].object_list
    assert [r.pk for r in only_api] == [api_record.pk]
    assert not client.get(reverse("history:requests"), {"status": "error"}).context["page"].object_list
    detail = client.get(reverse("history:request_detail", args=[api_record.pk]))
    assert detail.status_code == 200 and b"req-abc" in detail.content


def test_usage_page_shows_remaining_quota(client, user, conversation):
    response = login(client, user).get(reverse("history:usage"))
    assert response.status_code == 200
    status = response.context["status"]
    assert status.usage.tokens_today > 0
    assert status.tokens_remaining_today == 100_000 - status.usage.tokens_today


def test_another_users_objects_are_404(client, other_user, conversation, api_record):
    login(client, other_user)
    pk = conversation.pk
    for method, url in [
        ("get", reverse("chat:conversation", args=[pk])),
        ("get", reverse("history:export_json", args=[pk])),
        ("get", reverse("history:export_markdown", args=[pk])),
        ("post", reverse("history:rename", args=[pk])),
        ("post", reverse("history:delete", args=[pk])),
        ("get", reverse("history:request_detail", args=[api_record.pk])),
    ]:
        assert getattr(client, method)(url).status_code == 404, url
    assert Conversation.objects.filter(pk=pk).exists()
    assert str(pk) not in client.get(reverse("history:conversations")).content.decode()
    assert not client.get(reverse("history:requests")).context["page"].object_list
    assert client.get(reverse("history:usage")).context["status"].usage.tokens_today == 0
