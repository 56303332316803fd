"""Clients for the chaos scenarios: SSE streams through the official openai client and a playground
websocket through aiohttp (logged in with the session cookie, as a browser is), each in its own
thread, recording how it ended and when."""
from __future__ import annotations

import asyncio
import json
import threading
import time
from dataclasses import dataclass, field

import aiohttp
import openai

PROMPT = "Tell me a very long story about tiles"


@dataclass
class Outcome:
    """How one client's answer ended: 'finished', 'error' (an error event in the stream) or 'cut'
    (the connection broke without one); `at` is time.monotonic() when it ended."""

    kind: str = ""  # "sse" or "websocket"
    started: threading.Event = field(default_factory=threading.Event)  # the first text arrived
    ended: str = ""
    detail: str = ""
    at: float = 0.0
    done: threading.Event = field(default_factory=threading.Event)

    def end(self, how: str, detail: str = "") -> None:
        self.ended, self.detail, self.at = how, detail, time.monotonic()
        self.done.set()


def openai_client(base_url: str, api_key: str, timeout: float = 60) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url + "/v1", api_key=api_key, max_retries=0, timeout=timeout)


def sse_stream(base_url: str, api_key: str, model: str, max_tokens: int) -> Outcome:
    outcome = Outcome("sse")

    def run():
        try:
            chunks = openai_client(base_url, api_key).chat.completions.create(
                model=model, messages=[{"role": "user", "content": PROMPT}], max_tokens=max_tokens,
                temperature=0.0, stream=True, extra_body={"ignore_eos": True})
            for chunk in chunks:
                if chunk.choices and chunk.choices[0].delta.content:
                    outcome.started.set()
            outcome.end("finished")
        except openai.APIConnectionError as exc:
            outcome.end("cut", repr(exc))
        except openai.APIError as exc:  # an error event inside the stream (or an error status)
            outcome.end("error", str(exc))

    threading.Thread(target=run, daemon=True).start()
    return outcome


def ws_chat(base_url: str, username: str, password: str, max_tokens: int) -> Outcome:
    """A playground answer over /ws/chat/; 'error' is an error frame or a done frame whose message failed."""
    outcome = Outcome("websocket")

    async def chat():
        async with aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True)) as session:
            await log_in(session, base_url, username, password)
            async with session.ws_connect(base_url.replace("http", "ws", 1) + "/ws/chat/", origin=base_url) as ws:
                await ws.receive_json(timeout=30)  # ready
                await ws.send_json({"type": "send", "content": PROMPT,
                                    "settings": {"params": {"max_tokens": max_tokens, "temperature": 0}}})
                async for message in ws:
                    frame = json.loads(message.data)
                    if frame["type"] == "delta" and frame.get("text"):
                        outcome.started.set()
                    elif frame["type"] == "error":
                        return outcome.end("error", frame.get("code", ""))
                    elif frame["type"] == "done":
                        failed = frame["message"]["status"] == "error"
                        return outcome.end("error" if failed else "finished", frame["message"].get("error") or "")
                outcome.end("cut", "the socket closed")

    def run():
        try:
            asyncio.run(chat())
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            outcome.end("cut", repr(exc))

    threading.Thread(target=run, daemon=True).start()
    return outcome


async def log_in(session: aiohttp.ClientSession, base_url: str, username: str, password: str) -> None:
    async with session.get(base_url + "/accounts/login/") as response:
        response.raise_for_status()
    csrf = next(c.value for c in session.cookie_jar if c.key == "csrftoken")
    form = {"username": username, "password": password, "csrfmiddlewaretoken": csrf}
    async with session.post(base_url + "/accounts/login/", data=form,
                            headers={"Referer": base_url + "/accounts/login/"}) as response:
        response.raise_for_status()
    assert any(c.key == "sessionid" for c in session.cookie_jar), "the log-in did not take"
