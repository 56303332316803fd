"""Penalties from the playground's parameter panel reach the engine and work (issue 16).

Black box over the websocket: the same message with and without the penalty sliders, against a
real worker; a penalty used to fail the engine step and every answer in flight with it.
"""

import time

import pytest
from asgiref.sync import async_to_sync, sync_to_async
from channels.testing import WebsocketCommunicator
from chat_live_engine import session_cookie, slow_llm

pytestmark = pytest.mark.django_db(transaction=True)
PLAIN = {
    "temperature": 0,
    "max_tokens": 16,
    "repetition_penalty": 1.0,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
}
PENALIZED = {**PLAIN, "repetition_penalty": 1.6, "presence_penalty": 1.5, "frequency_penalty": 1.2}


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    return slow_llm(tiny_model_dir, step_delay_s=0.0)


async def answer(user, params: dict) -> dict:
    """Send one message in a new conversation; the final message frame."""
    from tessera.asgi import application

    headers = [
        (b"origin", b"http://testserver"),
        (b"host", b"testserver"),
        (b"cookie", await sync_to_async(session_cookie)(user)),
    ]
    ws = WebsocketCommunicator(application, "/ws/chat/", headers=headers)
    assert (await ws.connect(timeout=10))[0]
    assert (await ws.receive_json_from(timeout=10))["type"] == "ready"
    await ws.send_json_to(
        {"type": "send", "content": "Hello there", "settings": {"model": "tiny", "system_prompt": "", "params": params}}
    )
    deadline = time.monotonic() + 60
    while True:
        frame = await ws.receive_json_from(timeout=max(0.1, deadline - time.monotonic()))
        assert frame["type"] != "error", frame
        if frame["type"] == "done":
            await ws.disconnect()
            return frame["message"]


def test_penalty_sliders_change_the_answer_and_it_completes(user, worker):
    plain = async_to_sync(answer)(user, PLAIN)
    penalized = async_to_sync(answer)(user, PENALIZED)
    assert plain["status"] == penalized["status"] == "complete"
    assert penalized["content"] and penalized["content"] != plain["content"]
    assert worker.worker.counters["errors_total"] == 0
