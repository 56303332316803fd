"""The Batches web pages and the live progress feed (a Channels group on the real Redis channel layer)."""

from __future__ import annotations

import asyncio

import pytest
from batch_testing import chat_line, jsonl
from channels.routing import URLRouter
from channels.testing import WebsocketCommunicator
from django.urls import reverse

from batches import progress, services
from batches.models import Batch
from batches.routing import websocket_urlpatterns

CONTENT = jsonl([chat_line("a"), chat_line("b")])


def make_batch(user) -> Batch:
    file = services.upload_file(user, content=CONTENT, filename="in.jsonl", purpose="batch")
    return services.create_batch(
        user, input_file_id=file.public_id, endpoint="/v1/chat/completions", completion_window="24h"
    )


async def _connect(user, batch_id: str):
    communicator = WebsocketCommunicator(URLRouter(websocket_urlpatterns), f"/ws/batches/{batch_id}/")
    communicator.scope["user"] = user
    connected, code = await communicator.connect(timeout=5)
    return communicator, connected, code


@pytest.mark.django_db(transaction=True)
def test_progress_socket_sends_the_state_then_every_pushed_change(user):
    batch = make_batch(user)

    async def scenario():
        communicator, connected, _ = await _connect(user, batch.public_id)
        assert connected
        first = await communicator.receive_json_from(timeout=5)
        assert (first["id"], first["status"]) == (batch.public_id, "validating")
        from asgiref.sync import sync_to_async

        await sync_to_async(services.validate_batch)(batch.pk)  # -> in_progress, pushed to the group
        update = await communicator.receive_json_from(timeout=5)
        assert update["status"] == "in_progress" and update["request_counts"]["total"] == 2
        await communicator.disconnect()

    asyncio.run(scenario())


@pytest.mark.django_db(transaction=True)
def test_progress_socket_refuses_another_users_batch_and_anonymous(user, other_user):
    from django.contrib.auth.models import AnonymousUser

    batch = make_batch(user)

    async def scenario():
        communicator, connected, code = await _connect(other_user, batch.public_id)
        assert not connected and code == 4404
        communicator, connected, code = await _connect(AnonymousUser(), batch.public_id)
        assert not connected and code == 4401

    asyncio.run(scenario())


def test_group_names_are_valid_channels_group_names():
    name = progress.group_name("batch_" + "f" * 24)
    assert len(name) < 100 and all(c.isalnum() or c in "-_." for c in name)


@pytest.mark.django_db
def test_batches_page_upload_starts_a_batch_and_detail_shows_it(client, user):
    client.force_login(user)
    page = client.get(reverse("batches:list"))
    assert page.status_code == 200 and b"Upload and start" in page.content
    from django.core.files.uploadedfile import SimpleUploadedFile

    response = client.post(
        reverse("batches:upload"),
        {
            "file": SimpleUploadedFile("in.jsonl", CONTENT),
            "endpoint": "/v1/chat/completions",
            "description": "nightly eval",
        },
    )
    batch = Batch.objects.get(user=user)
    assert response.status_code == 302 and response["Location"] == reverse("batches:detail", args=[batch.public_id])
    assert batch.metadata == {"description": "nightly eval"}
    detail = client.get(response["Location"])
    assert detail.status_code == 200 and batch.public_id.encode() in detail.content
    assert b"/ws/batches/" in detail.content and b'id="batch-bar"' in detail.content
    listing = client.get(reverse("batches:list"))
    assert batch.public_id.encode() in listing.content and b"nightly eval" in listing.content


@pytest.mark.django_db
def test_page_shows_validation_errors_and_cancel_works(client, user):
    client.force_login(user)
    bad = services.upload_file(user, content=jsonl(["{oops", chat_line("x")]), filename="bad.jsonl", purpose="batch")
    failed = services.create_batch(
        user, input_file_id=bad.public_id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    services.validate_batch(failed.pk)
    page = client.get(reverse("batches:detail", args=[failed.public_id]))
    assert b"invalid_json_line" in page.content and b"Validation errors" in page.content
    running = make_batch(user)
    services.validate_batch(running.pk)
    response = client.post(reverse("batches:cancel", args=[running.public_id]))
    assert response.status_code == 302
    assert Batch.objects.get(pk=running.pk).status == Batch.Status.CANCELLING


@pytest.mark.django_db
def test_pages_and_downloads_of_another_user_are_404(client, user, other_user):
    batch = make_batch(user)
    client.force_login(other_user)
    assert client.get(reverse("batches:detail", args=[batch.public_id])).status_code == 404
    assert client.post(reverse("batches:cancel", args=[batch.public_id])).status_code == 404
    assert client.get(reverse("batches:download", args=[batch.input_file.public_id])).status_code == 404
    client.force_login(user)
    download = client.get(reverse("batches:download", args=[batch.input_file.public_id]))
    assert download.status_code == 200 and download.content == CONTENT


@pytest.mark.django_db
def test_pages_need_login(client):
    response = client.get(reverse("batches:list"))
    assert response.status_code == 302 and "login" in response["Location"]
