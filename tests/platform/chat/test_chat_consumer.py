"""The playground websocket against the real Redis channel layer and a running engine worker."""

import asyncio
import time

import pytest
from asgiref.sync import async_to_sync, sync_to_async
from channels.testing import WebsocketCommunicator
from chat_live_engine import session_cookie, slow_llm, wait_for

from chat.models import Conversation, Message
from engine_client import client as engine_client
from generation.services import collect
from quotas import selectors as quota_selectors
from usage.models import UsageRecord

pytestmark = pytest.mark.django_db(transaction=True)
SETTINGS = {"model": "tiny", "system_prompt": "", "params": {"temperature": 0, "max_tokens": 12}}
LONG = {"model": "tiny", "params": {"temperature": 0, "max_tokens": 400}}


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    return slow_llm(tiny_model_dir)


def application():
    from tessera.asgi import application as app

    return app


async def connect(user=None) -> WebsocketCommunicator:
    headers = [(b"origin", b"http://testserver"), (b"host", b"testserver")]
    if user is not None:
        headers.append((b"cookie", await sync_to_async(session_cookie)(user)))
    communicator = WebsocketCommunicator(application(), "/ws/chat/", headers=headers)
    connected, _ = await communicator.connect(timeout=10)
    assert connected
    return communicator


async def receive_until(communicator, kind: str, timeout: float = 30.0) -> list[dict]:
    """Frames up to and including the first of type `kind`."""
    frames = []
    deadline = time.monotonic() + timeout
    while True:
        frame = await communicator.receive_json_from(timeout=max(0.1, deadline - time.monotonic()))
        frames.append(frame)
        if frame["type"] == kind:
            return frames
        assert frame["type"] != "error" or kind == "error", frame


def deltas(frames) -> str:
    return "".join(f["text"] for f in frames if f["type"] == "delta")


async def wait_saved(message_id: int, timeout: float = 30.0) -> Message:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        message = await sync_to_async(Message.objects.get)(pk=message_id)
        if message.status != Message.Status.STREAMING:
            return message
        await asyncio.sleep(0.05)
    raise AssertionError("the reply was never saved")


def run(coro_fn):
    async_to_sync(coro_fn)()


def test_a_message_streams_token_by_token_and_is_saved(user, worker):
    async def scenario():
        ws = await connect(user)
        assert (await ws.receive_json_from())["type"] == "ready"
        await ws.send_json_to({"type": "send", "content": "Hello there", "settings": SETTINGS})
        frames = await receive_until(ws, "done")
        started = frames[0]
        assert started["type"] == "started" and started["message"]["status"] == "streaming"
        assert sum(f["type"] == "delta" for f in frames) >= 2  # arrived in pieces, not at the end
        done = frames[-1]["message"]
        assert done["status"] == "complete" and done["content"] == deltas(frames)
        stats = done["stats"]
        assert stats["completion_tokens"] > 0 and stats["prompt_tokens"] > 0 and stats["ttft_ms"] > 0
        await ws.disconnect()
        return started

    started = async_to_sync(scenario)()
    message = Message.objects.get(pk=started["message"]["id"])
    assert message.content and message.finish_reason in ("stop", "length")
    record = UsageRecord.objects.get(request_id=message.request_id)
    assert (record.source, record.completion_tokens) == ("playground", message.completion_tokens)
    assert 0 < record.engine_ttft_ms <= record.ttft_ms == message.ttft_ms, "from the worker's acceptance, inside"
    usage = quota_selectors.quota_status(user).usage
    assert usage.concurrent == 0
    assert usage.tokens_today == message.prompt_tokens + message.completion_tokens  # settled to actual use


def test_stop_aborts_the_request_in_the_engine(user, worker):
    async def scenario():
        ws = await connect(user)
        await ws.receive_json_from()
        await ws.send_json_to({"type": "send", "content": "Tell me a long story", "settings": LONG})
        await receive_until(ws, "delta")
        await ws.send_json_to({"type": "stop"})
        frames = await receive_until(ws, "done")
        await ws.disconnect()
        return frames[-1]["message"]

    done = async_to_sync(scenario)()
    assert done["status"] == "stopped" and done["finish_reason"] == "abort"
    assert 0 < done["stats"]["completion_tokens"] < 400
    engine = worker.worker.engine
    wait_for(lambda: not engine.has_unfinished_requests(), timeout=5)
    assert engine.get_stats()["num_running"] == 0
    assert quota_selectors.quota_status(user).usage.concurrent == 0


def test_reconnect_resumes_the_answer_and_the_owner_still_saves_it(user, worker):
    async def scenario():
        first = await connect(user)
        await first.receive_json_from()
        await first.send_json_to(
            {
                "type": "send",
                "content": "Count to fifty",
                "settings": {"model": "tiny", "params": {"temperature": 0, "max_tokens": 60}},
            }
        )
        frames = await receive_until(first, "delta")
        message_id = frames[0]["message"]["id"]
        await first.disconnect()  # a reload: the socket is gone mid-answer

        second = await connect(user)
        await second.receive_json_from()
        await second.send_json_to({"type": "resume", "message_id": message_id})
        replay = await receive_until(second, "done")
        await second.disconnect()
        saved = await wait_saved(message_id)
        return replay, saved

    replay, saved = async_to_sync(scenario)()
    assert replay[0]["type"] == "resumed"  # still generating when we came back
    assert deltas(replay) == saved.content  # the replay starts at the stream's beginning
    assert replay[-1]["message"]["content"] == saved.content
    assert saved.status == "complete" and saved.completion_tokens > 0
    assert quota_selectors.quota_status(user).usage.concurrent == 0


def test_a_disconnected_owner_saves_and_settles_without_any_socket(user, worker):
    async def scenario():
        ws = await connect(user)
        await ws.receive_json_from()
        await ws.send_json_to({"type": "send", "content": "Hi", "settings": SETTINGS})
        frames = await receive_until(ws, "started")
        await ws.disconnect()  # the stream is cut right away
        return await wait_saved(frames[-1]["message"]["id"])

    saved = async_to_sync(scenario)()
    assert saved.status == "complete"
    assert UsageRecord.objects.filter(request_id=saved.request_id).count() == 1
    assert quota_selectors.quota_status(user).usage.concurrent == 0


def test_regenerate_and_edit_over_the_socket_keep_branches(user, worker):
    async def scenario():
        ws = await connect(user)
        await ws.receive_json_from()
        await ws.send_json_to({"type": "send", "content": "First", "settings": SETTINGS})
        first = await receive_until(ws, "done")
        answer = first[-1]["message"]
        await ws.send_json_to({"type": "regenerate", "message_id": answer["id"], "settings": SETTINGS})
        regen = await receive_until(ws, "done")
        await ws.send_json_to(
            {"type": "edit", "message_id": first[0]["user_message"]["id"], "content": "Edited", "settings": SETTINGS}
        )
        edited = await receive_until(ws, "done")
        await ws.send_json_to({"type": "select_branch", "message_id": first[0]["user_message"]["id"]})
        branch = await receive_until(ws, "branch")
        await ws.disconnect()
        return answer, regen, edited, branch[-1]["messages"]

    answer, regen, edited, branch = async_to_sync(scenario)()
    assert regen[-1]["message"]["siblings"] == [answer["id"], regen[-1]["message"]["id"]]
    assert edited[0]["user_message"]["content"] == "Edited" and len(edited[0]["user_message"]["siblings"]) == 2
    assert [m["content"] for m in branch][0] == "First"
    assert branch[-1]["id"] == regen[-1]["message"]["id"]  # the newest answer on the old branch


def test_quota_refusal_is_a_readable_error_and_nothing_is_queued(user, worker, chat_settings):
    chat_settings.QUOTA_DEFAULT_PLAN = {"tokens_per_day": 10}

    async def scenario():
        ws = await connect(user)
        await ws.receive_json_from()
        await ws.send_json_to({"type": "send", "content": "Hello", "settings": SETTINGS})
        frame = await ws.receive_json_from(timeout=10)
        await ws.disconnect()
        return frame

    frame = async_to_sync(scenario)()
    assert frame["type"] == "error" and frame["code"] == "insufficient_quota"
    assert "quota" in frame["message"].lower() and frame["retry_after"] >= 1
    assert not Conversation.objects.exists()


def test_anonymous_sockets_are_refused(chat_settings):
    async def scenario():
        communicator = WebsocketCommunicator(application(), "/ws/chat/", headers=[(b"origin", b"http://testserver")])
        connected, code = await communicator.connect(timeout=5)
        return connected, code

    connected, code = async_to_sync(scenario)()
    assert not connected and code == 4401


def test_another_users_messages_are_not_found_over_the_socket(user, other_user, worker):
    async def scenario():
        ws = await connect(user)
        await ws.receive_json_from()
        await ws.send_json_to({"type": "send", "content": "Private", "settings": SETTINGS})
        done = (await receive_until(ws, "done"))[-1]["message"]
        await ws.disconnect()
        intruder = await connect(other_user)
        await intruder.receive_json_from()
        answers = []
        for frame in (
            {"type": "resume", "message_id": done["id"]},
            {"type": "regenerate", "message_id": done["id"], "settings": SETTINGS},
            {"type": "stop", "message_id": done["id"]},
            {"type": "select_branch", "message_id": done["id"]},
        ):
            await intruder.send_json_to(frame)
            answers.append(await intruder.receive_json_from(timeout=10))
        await intruder.disconnect()
        return answers

    answers = async_to_sync(scenario)()
    assert [a["type"] for a in answers] == ["error"] * 4
    assert {a["code"] for a in answers} <= {"not_found", "not_streaming"}
    assert Message.objects.count() == 2


def test_an_abandoned_answer_is_aborted_after_the_reconnect_grace(user, worker, chat_settings):
    chat_settings.CHAT_RECONNECT_GRACE_S = 1

    async def scenario():
        ws = await connect(user)
        await ws.receive_json_from()
        await ws.send_json_to({"type": "send", "content": "Go on and on", "settings": LONG})
        frames = await receive_until(ws, "delta")
        await ws.disconnect()  # and nobody comes back
        return await wait_saved(frames[0]["message"]["id"])

    saved = async_to_sync(scenario)()
    assert saved.status == "stopped" and saved.completion_tokens < 400
    assert UsageRecord.objects.get(request_id=saved.request_id).completion_tokens == saved.completion_tokens
    assert quota_selectors.quota_status(user).usage.concurrent == 0


def test_stale_replies_whose_follower_died_are_finished_from_the_engine_stream(user, worker):
    from chat import services

    orphan = services.send_message(user, "Hello", SETTINGS)  # its web process "died" after submitting
    engine_client.client().submit(
        model=orphan.model,
        prompt_token_ids=orphan.prompt_token_ids,
        sampling_params=orphan.sampling_params,
        request_id=orphan.request_id,
        priority_class="interactive",
    )
    expected = collect(orphan.request_id, timeout=30).text
    never_submitted = services.send_message(user, "Lost", SETTINGS)
    services.save_progress(never_submitted.message_id, "partial")
    assert services.finish_stale_replies(older_than_s=3600) == 0  # recent ones are left alone

    Message.objects.update(updated_at=Message.objects.first().created_at.replace(year=2000))
    assert services.finish_stale_replies(older_than_s=60, collect_timeout_s=1) == 2
    finished = Message.objects.get(pk=orphan.message_id)
    assert (finished.status, finished.content) == ("complete", expected)
    lost = Message.objects.get(pk=never_submitted.message_id)
    assert (lost.status, lost.content) == ("stopped", "partial")
    assert quota_selectors.quota_status(user).usage.concurrent == 0
    assert UsageRecord.objects.filter(user=user).count() == 2


def test_malformed_frames_get_an_error_not_a_crash(user, chat_settings):
    async def scenario():
        ws = await connect(user)
        await ws.receive_json_from()
        answers = []
        for raw in ("not json", "[1, 2]", '{"type": "launch"}'):
            await ws.send_to(text_data=raw)
            answers.append(await ws.receive_json_from(timeout=5))
        await ws.send_json_to({"type": "send", "content": "   ", "settings": SETTINGS})
        answers.append(await ws.receive_json_from(timeout=5))
        await ws.disconnect()
        return answers

    answers = async_to_sync(scenario)()
    assert [a["code"] for a in answers] == ["bad_frame", "bad_frame", "bad_frame", "invalid_request"]
