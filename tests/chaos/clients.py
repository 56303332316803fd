"""Clients for the chaos scenarios: SSE streams through the official openai client and a playground
websocket through aiohttp (logged in with the session cookie, as a browser is), each in its own
thread, recording how it ended and when."""

from __future__ import annotations

import asyncio
import json
import math
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

import aiohttp
import httpx
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
    text: str = ""  # the answer's text as it arrived (websocket: every delta, in order)
    message_id: int | None = None  # websocket: the assistant message and its conversation (the started frame)
    conversation_id: str = ""

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
                model=model,
                messages=[{"role": "user", "content": PROMPT}],
                max_tokens=max_tokens,
                temperature=0.0,
                stream=True,
                extra_body={"ignore_eos": True},
            )
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


def ws_chat(
    base_url: str, username: str, password: str, max_tokens: int, conversation_id: str | None = None
) -> Outcome:
    """A playground answer over /ws/chat/ (a new conversation, or a turn in conversation_id); 'error' is
    an error frame (its code in detail) or a done frame whose message failed."""
    outcome = Outcome("websocket")

    async def chat():
        async with aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True)) as session:
            await log_in(session, base_url, username, password)
            async with session.ws_connect(base_url.replace("http", "ws", 1) + "/ws/chat/", origin=base_url) as ws:
                await ws.receive_json(timeout=30)  # ready
                send = {
                    "type": "send",
                    "content": PROMPT,
                    "settings": {"params": {"max_tokens": max_tokens, "temperature": 0}},
                }
                if conversation_id:
                    send["conversation_id"] = conversation_id
                await ws.send_json(send)
                async for message in ws:
                    frame = json.loads(message.data)
                    if frame["type"] == "started":
                        outcome.message_id = frame["message"]["id"]
                        outcome.conversation_id = frame["conversation"]["id"]
                    elif frame["type"] == "delta" and frame.get("text"):
                        outcome.text += frame["text"]
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
    async with session.post(
        base_url + "/accounts/login/", data=form, headers={"Referer": base_url + "/accounts/login/"}
    ) as response:
        response.raise_for_status()
    assert any(c.key == "sessionid" for c in session.cookie_jar), "the log-in did not take"


# ---------------------------------------------------------------- load: many /v1 requests from one event loop


@dataclass
class StreamResult:
    """One SSE stream of /v1/completions with logprobs, as its client saw it (times are time.monotonic())."""

    status: int = 0
    error: str = ""  # a transport error, an error status's body or an error event in the stream
    sent_at: float = 0.0
    first_token_at: float | None = None
    ended_at: float = 0.0
    done: bool = False  # `data: [DONE]` arrived
    after_done: int = 0  # lines that came after it (there must be none)
    ids: set = field(default_factory=set)  # the chunks' "id" (one per stream)
    text: str = ""
    tokens: list = field(default_factory=list)  # logprobs.tokens of every chunk, in order
    offset_errors: list = field(default_factory=list)  # chunks whose text_offset does not continue the text
    finish_reasons: list = field(default_factory=list)
    usage: dict | None = None
    usage_chunks: int = 0

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_at is None else self.first_token_at - self.sent_at

    def problems(self, max_tokens: int) -> list[str]:
        """What is wrong with this stream: nothing lost, duplicated or left over, one id, one usage."""
        if self.status != 200 or self.error:
            return [f"status {self.status}: {self.error[:300]}"]
        found = []
        if not self.done:
            found.append("no data: [DONE]")
        if self.after_done:
            found.append(f"{self.after_done} lines after [DONE]")
        if len(self.ids) != 1:
            found.append(f"chunk ids {sorted(self.ids)}")
        if self.usage_chunks != 1 or self.usage is None:
            found.append(f"{self.usage_chunks} usage chunks")
            return found
        completion = self.usage.get("completion_tokens")
        if completion != max_tokens:
            found.append(f"usage.completion_tokens {completion}, asked for {max_tokens} with ignore_eos")
        if len(self.tokens) != completion:
            found.append(f"{len(self.tokens)} tokens streamed, usage says {completion}")
        if self.offset_errors:
            found.append(f"text_offset not continuing the text (a gap or a repeat): {self.offset_errors[:3]}")
        if self.finish_reasons != ["length"]:
            found.append(f"finish reasons {self.finish_reasons}")
        return found


def completion_body(model: str, prompt: str, max_tokens: int, stream: bool) -> dict:
    """Greedy, exactly max_tokens tokens (ignore_eos), each chunk carrying its tokens (logprobs=0)."""
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "logprobs": 0,
    }
    if stream:
        body.update(stream=True, stream_options={"include_usage": True})
    return body


def load_client(base_url: str, api_key: str, connections: int) -> httpx.AsyncClient:
    """One pool with a connection for each concurrent request (no request waits for another's)."""
    return httpx.AsyncClient(
        base_url=base_url,
        headers={"Authorization": f"Bearer {api_key}"},
        timeout=httpx.Timeout(300, connect=120, pool=None),
        limits=httpx.Limits(max_connections=connections, max_keepalive_connections=connections),
    )


async def completion_stream(http, body: dict) -> StreamResult:
    result = StreamResult(sent_at=time.monotonic())
    try:
        async with http.stream("POST", "/v1/completions", json=body) as response:
            result.status = response.status_code
            if response.status_code != 200:
                result.error = (await response.aread()).decode(errors="replace")
                return result
            async for line in response.aiter_lines():
                if line:
                    _stream_line(result, line)
    except httpx.HTTPError as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    finally:
        result.ended_at = time.monotonic()
    return result


def _stream_line(result: StreamResult, line: str) -> None:
    if result.done:
        result.after_done += 1
        return
    if not line.startswith("data: "):
        result.error = result.error or f"not an SSE data line: {line[:200]!r}"
        return
    data = line[len("data: ") :]
    if data == "[DONE]":
        result.done = True
        return
    chunk = json.loads(data)
    if "error" in chunk:
        result.error = f"error event: {chunk['error']}"
        return
    result.ids.add(chunk.get("id"))
    if chunk.get("usage"):
        result.usage_chunks += 1
        result.usage = chunk["usage"]
    for choice in chunk.get("choices") or []:
        if choice.get("index") != 0:
            result.error = result.error or f"choice index {choice.get('index')}"
        logprobs = choice.get("logprobs") or {}
        tokens = logprobs.get("tokens") or []
        if (choice.get("text") or tokens) and result.first_token_at is None:
            result.first_token_at = time.monotonic()
        # As vLLM's: a chunk's first token sits where the text streamed so far ends, the next ones
        # follow by their token strings' lengths (so a lost or repeated chunk shows here).
        expected = [len(result.text) + sum(len(t) for t in tokens[:k]) for k in range(len(tokens))]
        if (logprobs.get("text_offset") or []) != expected:
            result.offset_errors.append((logprobs.get("text_offset"), expected))
        result.text += choice.get("text") or ""
        result.tokens += tokens
        if choice.get("finish_reason"):
            result.finish_reasons.append(choice["finish_reason"])


async def completion_streams(base_url: str, api_key: str, bodies: list[dict]) -> tuple[list[StreamResult], float]:
    """Every body as its own SSE stream, all at once, on a connection each; (results, wall seconds)."""
    started = time.monotonic()
    async with load_client(base_url, api_key, len(bodies)) as http:
        results = await asyncio.gather(*(completion_stream(http, body) for body in bodies))
    return list(results), time.monotonic() - started


@dataclass
class Answer:
    """One non-streaming /v1 answer: status (0: a transport error), headers, parsed body."""

    status: int
    headers: dict
    body: dict
    error: str = ""


async def post_json(http, path: str, body: dict) -> Answer:
    try:
        response = await http.post(path, json=body)
    except httpx.HTTPError as exc:
        return Answer(0, {}, {}, f"{type(exc).__name__}: {exc}")
    try:
        parsed = response.json()
    except ValueError:
        parsed = {"raw": response.text[:300]}
    return Answer(response.status_code, dict(response.headers), parsed)


def quantile(values: list[float], q: float) -> float:
    """The q-quantile by the nearest rank (p99 of 100 values is the 99th smallest)."""
    ordered = sorted(values)
    return ordered[max(1, math.ceil(q * len(ordered))) - 1]


# ---------------------------------------------------------------- batches


FINAL_BATCH_STATUSES = ("completed", "failed", "expired", "cancelled")


def batch_lines(model: str, count: int) -> list[dict]:
    """count chat-completion lines (greedy, 48 tokens each), custom_id chaos-0 ... chaos-{count - 1}."""
    return [
        {
            "custom_id": f"chaos-{i}",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {
                "model": model,
                "max_tokens": 48,
                "temperature": 0,
                "ignore_eos": True,
                "messages": [{"role": "user", "content": f"Item {i}: tell me about number {i}."}],
            },
        }
        for i in range(count)
    ]


def create_batch(client: openai.OpenAI, lines: list[dict]):
    upload = client.files.create(
        file=("chaos.jsonl", "".join(json.dumps(x) + "\n" for x in lines).encode()), purpose="batch"
    )
    return client.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h")


def wait_for_batch(client: openai.OpenAI, batch_id: str, until, timeout: float, tick=None, detail=None):
    """The batch once until(batch) holds (polled; tick() runs between polls, e.g. a supervisor's tend();
    detail() says what went wrong if the timeout, which only bounds a failure, passes)."""
    deadline = time.monotonic() + timeout
    while not until(batch := client.batches.retrieve(batch_id)):
        assert time.monotonic() < deadline, (batch, detail() if detail else "")
        if tick is not None:
            tick()
        time.sleep(0.1)
    return batch


def check_exactly_once(client: openai.OpenAI, final, lines: list[dict]) -> None:
    """The batch completed with request_counts exact and its output holds every custom_id exactly once, each 200."""
    counts = final.request_counts
    assert (final.status, counts.total, counts.completed, counts.failed) == ("completed", len(lines), len(lines), 0), (
        final
    )
    rows = [json.loads(line) for line in client.files.content(final.output_file_id).text.splitlines()]
    seen = Counter(row["custom_id"] for row in rows)
    assert seen == Counter(line["custom_id"] for line in lines), seen
    assert all(row["response"]["status_code"] == 200 for row in rows), [
        r for r in rows if r["response"]["status_code"] != 200
    ]
