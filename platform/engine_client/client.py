"""The one way Django code talks to engine workers: submit, stream (sync/async), abort, health.

Every caller (OpenAI API views, the playground consumer, the batch runner, the dashboard) uses
this module; nothing else touches the engine's Redis keys. Protocol: docs/protocol.md.

    rid = submit(prompt_token_ids=[1, 2, 3], sampling_params={"max_tokens": 16}, priority_class="api")
    for event in stream(rid):          # or: async for event in astream(rid)
        if event["type"] == "delta":   # {"index", "text", "token_ids", "logprobs"?, "finish_reason", "stop_reason"}
            ...
        elif event["type"] == "finish":  # {"finish_reasons", "usage": {prompt,completion,cached}_tokens, "metrics"}
            ...
        elif event["type"] == "error":   # {"code", "message", "param"?}; codes in ERROR_CODES
            ...
    abort(rid)                          # stop button / disconnect; the worker frees blocks within one step

The stream always ends with exactly one terminal event (finish or error): a dead worker or no
worker at all is reported as an error event, never as an endless wait.
"""
from __future__ import annotations

import asyncio
import time
import uuid
import weakref
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass

import redis
import redis.asyncio as aioredis
from django.conf import settings

from . import protocol as p

# Codes of error events: worker-side validation, a lost or missing worker, engine failure.
ERROR_CODES = ("invalid_request", "worker_lost", "no_worker", "engine_error", "worker_shutdown",
               "expired", "timeout")

POLL_MS = 1000  # how long one XREAD blocks before liveness is re-checked
REQUEST_STREAM_MAXLEN = 100_000
OUTPUT_TTL_S = 3600


class EngineUnavailable(Exception):
    """No engine worker has a fresh heartbeat (the API answers 503)."""


# ---------------------------------------------------------------- connections

_sync_client: redis.Redis | None = None
_async_clients: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, aioredis.Redis]" = weakref.WeakKeyDictionary()


def redis_client() -> redis.Redis:
    global _sync_client
    if _sync_client is None:
        _sync_client = redis.Redis.from_url(settings.REDIS_URL)
    return _sync_client


def async_redis_client() -> aioredis.Redis:
    """One asyncio client per event loop (asyncio connections cannot cross loops)."""
    loop = asyncio.get_running_loop()
    client = _async_clients.get(loop)
    if client is None:
        client = aioredis.Redis.from_url(settings.REDIS_URL)
        _async_clients[loop] = client
    return client


# ---------------------------------------------------------------- submit / abort

def new_request_id() -> str:
    return uuid.uuid4().hex


def build_request(*, prompt_token_ids=None, prompt=None, sampling_params: dict | None = None,
                  priority_class: str = "api", priority: int = 0, user=None,
                  request_id: str | None = None, queue_timeout: float | None = None) -> dict:
    if (prompt_token_ids is None) == (prompt is None):
        raise ValueError("give exactly one of prompt_token_ids or prompt")
    now = time.time()
    return {
        "request_id": request_id or new_request_id(),
        "prompt_token_ids": list(prompt_token_ids) if prompt_token_ids is not None else None,
        "prompt": prompt,
        "sampling_params": dict(sampling_params or {}),
        "priority": p.engine_priority(priority_class, priority),
        "priority_class": priority_class,
        "user": None if user is None else str(user),
        "submitted_at": now,
        "deadline": now + queue_timeout if queue_timeout else None,
    }


def _xadd_args(message: dict) -> tuple:
    return (p.REQUEST_STREAM, {"data": p.encode(message)}), {"maxlen": REQUEST_STREAM_MAXLEN, "approximate": True}


def submit(**kwargs) -> str:
    """Queue one generation request for the engine workers and return its request id.

    Keyword args: prompt_token_ids (list[int]) or prompt (str); sampling_params (dict of
    inference.SamplingParams fields); priority_class "interactive" | "api" | "batch"; priority
    (0..999 inside the class, lower first); user; request_id (default: a fresh uuid);
    queue_timeout (s): a worker that picks the request up later fails it with code "expired".
    Raises ValueError for a bad priority class or prompt arguments.
    """
    message = build_request(**kwargs)
    args, opts = _xadd_args(message)
    redis_client().xadd(*args, **opts)
    return message["request_id"]


async def asubmit(**kwargs) -> str:
    message = build_request(**kwargs)
    args, opts = _xadd_args(message)
    await async_redis_client().xadd(*args, **opts)
    return message["request_id"]


def _abort_ops(pipe, request_id: str) -> None:
    # The key catches requests still queued in the stream; the pub/sub message reaches running ones.
    pipe.set(p.aborted_key(request_id), "1", ex=OUTPUT_TTL_S)
    pipe.publish(p.ABORT_CHANNEL, request_id)


def abort(request_id: str) -> None:
    """Ask the worker running `request_id` to stop it; its stream then ends with finish_reason 'abort'."""
    pipe = redis_client().pipeline(transaction=False)
    _abort_ops(pipe, request_id)
    pipe.execute()


async def aabort(request_id: str) -> None:
    pipe = async_redis_client().pipeline(transaction=False)
    _abort_ops(pipe, request_id)
    await pipe.execute()


def delete_output(request_id: str) -> None:
    """Drop a finished request's output stream now instead of waiting for its expiry."""
    redis_client().delete(p.output_stream(request_id))


# ---------------------------------------------------------------- streaming

class _Watch:
    """Liveness bookkeeping for one stream: who claimed the request, and for how long no one has."""

    def __init__(self, request_id: str, no_worker_grace: float, timeout: float | None):
        self.request_id = request_id
        self.worker_id: str | None = None
        self.started = time.monotonic()
        self.no_worker_since: float | None = None
        self.no_worker_grace = no_worker_grace
        self.timeout = timeout

    def see(self, event: dict) -> None:
        if event.get("type") == "accepted":
            self.worker_id = event.get("worker_id")

    def liveness_keys(self) -> list[str]:
        if self.worker_id:
            return [p.heartbeat_key(self.worker_id)]
        return []

    def liveness(self, live_workers: set[str]) -> tuple[bool, bool]:
        """(the claiming worker is alive, any worker is alive) from a set of live worker ids."""
        return self.worker_id in live_workers, bool(live_workers)

    def verdict(self, claimed_alive: bool, any_alive: bool) -> dict | None:
        """An error event when waiting longer is pointless, else None."""
        now = time.monotonic()
        if self.timeout is not None and now - self.started > self.timeout:
            return _error("timeout", f"no result within {self.timeout:g}s")
        if self.worker_id:
            if not claimed_alive:
                return _error("worker_lost", f"engine worker {self.worker_id} stopped responding mid-request")
            return None
        if any_alive:
            self.no_worker_since = None
            return None
        self.no_worker_since = self.no_worker_since or now
        if now - self.no_worker_since >= self.no_worker_grace:
            return _error("no_worker", "no engine worker is running")
        return None


def _error(code: str, message: str) -> dict:
    return {"type": "error", "code": code, "message": message}


def _pass_on(events: list[dict], watch: _Watch, include_control: bool) -> tuple[list[dict], bool]:
    """The events a reader yields from one read (control events hidden), and whether the last ends it."""
    shown = []
    for event in events:
        watch.see(event)
        if event["type"] == "accepted" and not include_control:
            continue
        shown.append(event)
        if event["type"] in p.TERMINAL_EVENTS:
            return shown, True
    return shown, False


def _unpack(entries):
    """XREAD reply -> (last entry id, events)."""
    last_id, events = None, []
    for _stream, items in entries or []:
        for entry_id, fields in items:
            last_id = _entry_id(entry_id)
            for event in p.decode(fields[b"events"]):
                event["entry_id"] = last_id
                events.append(event)
    return last_id, events


def stream(request_id: str, *, last_id: str = "0-0", timeout: float | None = None,
           no_worker_grace: float = 5.0, include_control: bool = False) -> Iterator[dict]:
    """Yield the request's events until one terminal event (finish or error) has been yielded.

    last_id resumes after an earlier event's "entry_id" (a reconnecting browser); "0-0" replays all.
    timeout bounds the whole wait (error code "timeout"). The "accepted" control event (which
    worker claimed the request) is only yielded with include_control=True.
    Closing the generator early does NOT abort the request; call abort() for that.
    """
    r = redis_client()
    watch = _Watch(request_id, no_worker_grace, timeout)
    key = p.output_stream(request_id)
    while True:
        reply = r.xread({key: last_id}, block=POLL_MS, count=256)
        new_last, events = _unpack(reply)
        if new_last:
            last_id = new_last
        shown, ended = _pass_on(events, watch, include_control)
        yield from shown
        if ended:
            return
        if not events:
            error = watch.verdict(*_liveness(r, watch))
            if error:
                abort(request_id)  # a worker that comes back later must not run it
                yield error
                return


async def astream(request_id: str, *, last_id: str = "0-0", timeout: float | None = None,
                  no_worker_grace: float = 5.0, include_control: bool = False) -> AsyncIterator[dict]:
    """Async twin of stream() (for ASGI views and Channels consumers).

    Every astream of one event loop shares that loop's StreamHub: one XREAD per engine step for all
    of them instead of one per stream.
    """
    watch = _Watch(request_id, no_worker_grace, timeout)
    hub = stream_hub()
    inbox = await hub.follow(p.output_stream(request_id), last_id)
    try:
        while True:
            batch = await inbox.get()
            if isinstance(batch, BaseException):
                raise batch
            if isinstance(batch, _Tick):  # nothing for POLL_MS: is anyone still working on it?
                error = watch.verdict(*watch.liveness(batch.live_workers))
                if error:
                    await aabort(request_id)
                    yield error
                    return
                continue
            shown, ended = _pass_on(batch, watch, include_control)
            for event in shown:
                yield event
            if ended:
                return
    finally:
        hub.unfollow(p.output_stream(request_id), inbox)


class StreamHub:
    """Reads the output streams of every astream on one event loop with a single blocking XREAD.

    Each follower gets an asyncio queue of batches: a list of events per XREAD reply, a _Tick when
    its stream was quiet for POLL_MS (with the live worker ids, read once for all quiet streams),
    or the exception that stopped the reader. A follower that joins while the XREAD blocks wakes
    it through the hub's own wake stream, so its first events are not held back until the block
    times out; a burst of followers sends one wake, since the next XREAD names them all. Two
    followers of one stream (a browser tab that reconnects) each get every entry after their own
    last id.
    """

    def __init__(self, r: aioredis.Redis):
        self.r = r
        self.wake_key = f"{p.PREFIX}:hub-wake:{uuid.uuid4().hex}"
        self.wake_id = "0-0"  # the key is new: its first entry, whenever it comes, wakes the XREAD
        self.by_key: dict[str, dict[asyncio.Queue, _Follower]] = {}
        self.reader: asyncio.Task | None = None
        self.wake_sent = False  # one wake per blocked XREAD: a burst of followers must not re-read n times

    async def follow(self, key: str, last_id: str) -> asyncio.Queue:
        inbox: asyncio.Queue = asyncio.Queue()
        self.by_key.setdefault(key, {})[inbox] = _Follower(_id_tuple(last_id), time.monotonic())
        if self.reader is None or self.reader.done():
            self.reader = asyncio.get_running_loop().create_task(self._read())
        elif not self.wake_sent:
            self.wake_sent = True
            pipe = self.r.pipeline(transaction=False)
            pipe.xadd(self.wake_key, {"w": "1"}, maxlen=1)
            pipe.expire(self.wake_key, OUTPUT_TTL_S)
            await pipe.execute()
        return inbox

    def unfollow(self, key: str, inbox: asyncio.Queue) -> None:
        followers = self.by_key.get(key, {})
        followers.pop(inbox, None)
        if not followers:
            self.by_key.pop(key, None)

    async def _read(self) -> None:
        try:
            while self.by_key:
                self.wake_sent = False  # whoever follows after this query is built has to wake the XREAD
                query = {key: "%d-%d" % min(f.last_id for f in followers.values())
                         for key, followers in self.by_key.items()}
                query[self.wake_key] = self.wake_id
                self._deliver(await self.r.xread(query, block=POLL_MS, count=256))
                await self._tick_quiet()
        except Exception as exc:  # Redis went away: every follower hears it
            for followers in self.by_key.values():
                for inbox in followers:
                    inbox.put_nowait(exc)
            self.by_key.clear()

    def _deliver(self, reply) -> None:
        now = time.monotonic()
        for raw_key, items in reply or []:
            key = _entry_id(raw_key)
            if key == self.wake_key:
                self.wake_id = _entry_id(items[-1][0])
                continue
            for inbox, f in self.by_key.get(key, {}).items():
                mine = [(entry_id, fields) for entry_id, fields in items if _id_tuple(_entry_id(entry_id)) > f.last_id]
                if mine:
                    inbox.put_nowait(_unpack([(raw_key, mine)])[1])
                    f.last_id, f.seen = _id_tuple(_entry_id(mine[-1][0])), now

    async def _tick_quiet(self) -> None:
        now = time.monotonic()
        quiet = [(inbox, f) for followers in self.by_key.values() for inbox, f in followers.items()
                 if now - f.seen >= POLL_MS / 1000]
        if not quiet:
            return
        tick = _Tick(await alive_worker_ids(self.r))
        for inbox, f in quiet:
            inbox.put_nowait(tick)
            f.seen = now


@dataclass
class _Follower:
    last_id: tuple[int, int]
    seen: float  # when it last got events or a tick


@dataclass
class _Tick:
    live_workers: set[str]


def _id_tuple(entry_id: str) -> tuple[int, int]:
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)


_hubs: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, StreamHub]" = weakref.WeakKeyDictionary()


def stream_hub() -> StreamHub:
    loop = asyncio.get_running_loop()
    hub = _hubs.get(loop)
    if hub is None:
        hub = _hubs[loop] = StreamHub(async_redis_client())
    return hub


def _entry_id(raw) -> str:
    return raw.decode() if isinstance(raw, bytes) else raw


def _liveness(r, watch: _Watch) -> tuple[bool, bool]:
    keys = watch.liveness_keys()
    if keys:
        return bool(r.exists(*keys)), True
    return False, bool(live_worker_ids(r))


async def alive_worker_ids(r) -> set[str]:
    """Workers whose heartbeat key still exists (async, read-only twin of live_worker_ids)."""
    ids = sorted(m.decode() for m in await r.smembers(p.WORKERS_SET))
    if not ids:
        return set()
    pipe = r.pipeline(transaction=False)
    for worker_id in ids:
        pipe.exists(p.heartbeat_key(worker_id))
    return {w for w, ok in zip(ids, await pipe.execute()) if ok}


# ---------------------------------------------------------------- collecting a whole result

def new_result() -> dict:
    return {"choices": {}, "usage": None, "metrics": None, "error": None, "finish_reasons": None}


def fold(result: dict, event: dict) -> dict:
    """Accumulate one event into a result dict (see collect())."""
    kind = event["type"]
    if kind == "delta":
        choice = result["choices"].setdefault(event["index"], {
            "index": event["index"], "text": "", "token_ids": [], "logprobs": [],
            "finish_reason": None, "stop_reason": None})
        choice["text"] += event.get("text", "")
        choice["token_ids"].extend(event.get("token_ids", []))
        choice["logprobs"].extend(event.get("logprobs") or [])
        if event.get("finish_reason"):
            choice["finish_reason"] = event["finish_reason"]
            choice["stop_reason"] = event.get("stop_reason")
    elif kind == "finish":
        result["usage"] = event.get("usage")
        result["metrics"] = event.get("metrics")
        result["finish_reasons"] = event.get("finish_reasons")
    elif kind == "error":
        result["error"] = {k: v for k, v in event.items() if k not in ("type", "entry_id")}
    return result


def finalize(result: dict, n: int | None) -> dict:
    choices = result["choices"]
    for index in range(n or 0):
        choices.setdefault(index, {"index": index, "text": "", "token_ids": [], "logprobs": [],
                                   "finish_reason": None, "stop_reason": None})
    for index, reason in enumerate(result["finish_reasons"] or []):
        if index in choices and reason and not choices[index]["finish_reason"]:
            choices[index]["finish_reason"] = reason
    result["choices"] = [choices[i] for i in sorted(choices)]
    return result


def collect(request_id: str, *, n: int | None = None, timeout: float | None = None) -> dict:
    """Run a request's stream to the end: {"choices": [{index,text,token_ids,logprobs,finish_reason,
    stop_reason}], "usage", "metrics", "finish_reasons", "error" (None or {"code","message"})}."""
    result = new_result()
    for event in stream(request_id, timeout=timeout):
        fold(result, event)
    return finalize(result, n)


async def acollect(request_id: str, *, n: int | None = None, timeout: float | None = None) -> dict:
    result = new_result()
    async for event in astream(request_id, timeout=timeout):
        fold(result, event)
    return finalize(result, n)


# ---------------------------------------------------------------- health and worker stats

def live_worker_ids(r=None) -> list[str]:
    r = r or redis_client()
    ids = sorted(m.decode() for m in r.smembers(p.WORKERS_SET))
    if not ids:
        return []
    pipe = r.pipeline(transaction=False)
    for worker_id in ids:
        pipe.exists(p.heartbeat_key(worker_id))
    alive = pipe.execute()
    stale = [w for w, ok in zip(ids, alive) if not ok]
    if stale:
        r.srem(p.WORKERS_SET, *stale)
    return [w for w, ok in zip(ids, alive) if ok]


def _parse_heartbeat(raw: dict) -> dict:
    info = {k.decode(): v.decode() for k, v in raw.items()}
    for field in ("stats", "config"):
        if field in info:
            info[field] = p.decode(info[field])
    for field in ("updated_at", "started_at"):
        if field in info:
            info[field] = float(info[field])
    return info


_workers_cache: tuple[float, list[dict]] = (float("-inf"), [])


def workers(max_age: float = 0.0) -> list[dict]:
    """Live workers' heartbeats: worker_id, model, served_model_name, pid, host, started_at,
    updated_at (unix s), config (engine args, max_model_len), stats (engine.get_stats() plus
    tokens_per_s, inflight, requests_total, aborts_total, errors_total, step_ms).

    max_age > 0 may answer from a snapshot up to that many seconds old (per-request callers on the
    hot path: three Redis round trips per API request otherwise).
    """
    global _workers_cache
    taken, cached = _workers_cache
    if max_age > 0 and time.monotonic() - taken < max_age:
        return cached
    r = redis_client()
    ids = live_worker_ids(r)
    pipe = r.pipeline(transaction=False)
    for worker_id in ids:
        pipe.hgetall(p.heartbeat_key(worker_id))
    found = [_parse_heartbeat(raw) for raw in pipe.execute() if raw]
    _workers_cache = (time.monotonic(), found)
    return found


def clear_workers_snapshot() -> None:
    """Forget the snapshot behind workers(max_age=...) (tests that start and stop workers)."""
    global _workers_cache
    _workers_cache = (float("-inf"), [])


async def aworkers() -> list[dict]:
    r = async_redis_client()
    ids = sorted(m.decode() for m in await r.smembers(p.WORKERS_SET))
    pipe = r.pipeline(transaction=False)
    for worker_id in ids:
        pipe.hgetall(p.heartbeat_key(worker_id))
    return [_parse_heartbeat(raw) for raw in await pipe.execute() if raw]


def block_maps() -> dict[str, object]:
    """worker_id -> the worker's latest engine.block_map() snapshot (published at most once a second)."""
    r = redis_client()
    ids = live_worker_ids(r)
    raws = r.mget([p.block_map_key(w) for w in ids]) if ids else []
    return {w: p.decode(raw) for w, raw in zip(ids, raws) if raw}


def health() -> dict:
    """{"ok": at least one fresh heartbeat, "workers": [worker_id...], "redis": reachable}."""
    try:
        ids = live_worker_ids()
    except redis.RedisError as exc:
        return {"ok": False, "redis": False, "workers": [], "error": str(exc)}
    return {"ok": bool(ids), "redis": True, "workers": ids}


async def ahealth() -> dict:
    try:
        live = await aworkers()
    except redis.RedisError as exc:
        return {"ok": False, "redis": False, "workers": [], "error": str(exc)}
    return {"ok": bool(live), "redis": True, "workers": [w["worker_id"] for w in live]}


def require_worker() -> None:
    if not health()["ok"]:
        raise EngineUnavailable("no engine worker is running")


async def arequire_worker() -> list[dict]:
    live = await aworkers()
    if not live:
        raise EngineUnavailable("no engine worker is running")
    return live
