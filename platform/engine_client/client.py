"""The one way Django code talks to engine workers: one sync client and one async client.

Protocol and message types: inference/protocol.py (docs/protocol.md). Both clients do the same
things with the same rules; they differ only in how they wait for Redis.

    engine = client()                  # sync, one per process (batch runner, management code)
    rid = engine.submit(model="tiny", prompt_token_ids=[1, 2, 3], sampling_params={"max_tokens": 16})
    for event in engine.stream(rid, model="tiny"):   # async: `async for event in aclient().stream(...)`
        if event["type"] == "delta":   # {"index", "text", "token_ids", "logprobs"?, "finish_reason", "stop_reason"}
            ...
        elif event["type"] == "finish":  # {"finish_reasons", "usage": {prompt,completion,cached}_tokens, "metrics"}
            ...
        elif event["type"] == "error":   # {"code", "message"}; codes in protocol.ERROR_CODES
            ...
    engine.abort(rid)                  # stop button / disconnect; the worker frees blocks within one step

A stream always ends with exactly one terminal event (finish or error): a dead worker, or no live
worker serving the request's model, is reported as an error event, never as an endless wait.
Liveness.verdict is that rule, shared by both streams and the batch collector. Folding events
into a whole answer is the generation service's (generation.result.Result).
"""

from __future__ import annotations

import asyncio
import time
import uuid
import weakref
from collections import OrderedDict
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import cast

import redis
import redis.asyncio as aioredis
from redis.typing import KeyT, StreamIdT

from common import connections
from inference import protocol

POLL_MS = 1000  # how long one XREAD blocks before liveness is re-checked
NO_WORKER_GRACE_S = 5.0

LiveWorkers = dict[str, list[str]]  # worker id -> the model names it serves
LIVENESS_FIELDS = ("served_model_names", "model")


# ---------------------------------------------------------------- rules shared by both clients


class Liveness:
    """Whether waiting longer for one request is pointless: timeout, its worker died, nobody serves it."""

    def __init__(
        self, model: str | None = None, *, no_worker_grace: float = NO_WORKER_GRACE_S, timeout: float | None = None
    ):
        self.model = model  # None: any live worker counts
        self.worker_id: str | None = None
        self.started = time.monotonic()
        self.no_worker_since: float | None = None
        self.no_worker_grace = no_worker_grace
        self.timeout = timeout

    def see(self, event: dict) -> None:
        if event.get("type") == "accepted":
            self.worker_id = event.get("worker_id")

    def verdict(self, live: LiveWorkers) -> protocol.ErrorEvent | None:
        """An error event when the request can no longer finish, else None."""
        now = time.monotonic()
        if self.timeout is not None and now - self.started > self.timeout:
            return protocol.error_event("timeout", f"no result within {self.timeout:g}s")
        if self.worker_id:
            if self.worker_id not in live:
                return protocol.error_event(
                    "worker_lost", f"engine worker {self.worker_id} stopped responding mid-request"
                )
            return None
        if any(self.model is None or self.model in names for names in live.values()):
            self.no_worker_since = None
            return None
        self.no_worker_since = self.no_worker_since or now
        if now - self.no_worker_since >= self.no_worker_grace:
            return protocol.error_event(
                "no_worker",
                "no engine worker is running" if self.model is None else f"no engine worker is serving '{self.model}'",
            )
        return None


def _pass_on(events: list[dict], liveness: Liveness, include_control: bool) -> tuple[list[dict], bool]:
    """The events a reader yields from one read (control events hidden), and whether the last ends it."""
    shown = []
    for event in events:
        liveness.see(event)
        if event["type"] == "accepted" and not include_control:
            continue
        shown.append(event)
        if event["type"] in protocol.TERMINAL_EVENTS:
            return shown, True
    return shown, False


def _text(raw) -> str:
    return raw.decode() if isinstance(raw, bytes) else raw


def _unpack(entries) -> tuple[str | None, list[dict]]:
    """XREAD/XRANGE reply -> (last entry id, events, each tagged with its entry_id)."""
    last_id, events = None, []
    for _stream, items in entries or []:
        for entry_id, fields in items:
            last_id = _text(entry_id)
            for event in protocol.events_of(fields):
                tagged = cast(dict, event)  # past this point events are plain dicts with their entry id
                tagged["entry_id"] = last_id
                events.append(tagged)
    return last_id, events


def _live(ids: list[str], replies: list) -> LiveWorkers:
    """Live workers from their ids and an HMGET of (served_model_names, model) each; both None: no key."""
    return {
        w: cast(list[str], protocol.decode(names)) if names is not None else [_text(model)]
        for w, (names, model) in zip(ids, replies)
        if names is not None or model is not None
    }


def _abort_ops(pipe, request_id: str) -> None:
    # The key catches requests still queued in the stream; the pub/sub message reaches running ones.
    pipe.set(protocol.aborted_key(request_id), "1", ex=protocol.OUTPUT_TTL_S)
    pipe.publish(protocol.ABORT_CHANNEL, request_id)


def _lease_ops(pipe, lease_id: str) -> None:
    pipe.set(protocol.lease_key(lease_id), "1", px=int(protocol.LEASE_TTL_S * 1000))


def _xadd_args(request: protocol.EngineRequest) -> tuple:
    return (request.stream, request.fields()), {"maxlen": protocol.REQUEST_STREAM_MAXLEN, "approximate": True}


def _health(live: LiveWorkers) -> dict:
    return {"ok": bool(live), "redis": True, "workers": sorted(live)}


# ---------------------------------------------------------------- the sync client


class EngineClient:
    """Blocking client (threads, Celery tasks, management commands)."""

    def __init__(self, r: redis.Redis):
        self.r = r
        self._workers_cache: tuple[float, list[dict]] = (float("-inf"), [])

    def submit(self, *, lease_id: str | None = None, **kwargs) -> str:
        """Queue one request on its model's stream; returns the request id.

        Keyword args are EngineRequest.build's: model (required), prompt_token_ids (list[int]) or
        prompt (str), sampling_params (inference.SamplingParams fields), priority_class
        "interactive" | "api" | "batch", priority (0..999 inside the class), user, request_id,
        queue_timeout (s: a worker that picks it up later fails it with "expired"). ValueError for bad ones.
        lease_id: the lease of the event loop that follows the request (AsyncEngineClient.lease());
        the worker aborts it once that lease lapses. Without one (batch) nothing aborts it.
        """
        request = protocol.EngineRequest.build(lease_id=lease_id, **kwargs)
        args, opts = _xadd_args(request)
        pipe = self.r.pipeline(transaction=False)
        if lease_id:
            _lease_ops(pipe, lease_id)  # a new lease exists before the worker can check it
        pipe.xadd(*args, **opts)
        pipe.execute()
        return request.request_id

    def abort(self, request_id: str) -> None:
        """Ask the worker running `request_id` to stop it; its stream then ends with finish_reason 'abort'."""
        pipe = self.r.pipeline(transaction=False)
        _abort_ops(pipe, request_id)
        pipe.execute()

    def stream(
        self,
        request_id: str,
        *,
        model: str | None = None,
        last_id: str = "0-0",
        timeout: float | None = None,
        no_worker_grace: float = NO_WORKER_GRACE_S,
        include_control: bool = False,
    ) -> Iterator[dict]:
        """Yield the request's events until one terminal event (finish or error) has been yielded.

        last_id resumes after an earlier event's "entry_id" (a reconnecting browser); "0-0" replays all.
        timeout bounds the whole wait (error "timeout"); model names who may pick it up (error
        "no_worker" when no live worker serves it). The "accepted" control event is only yielded
        with include_control=True. Closing the generator early does NOT abort the request.
        """
        liveness = Liveness(model, no_worker_grace=no_worker_grace, timeout=timeout)
        key = protocol.output_stream(request_id)
        while True:
            new_last, events = _unpack(self.r.xread({key: last_id}, block=POLL_MS, count=256))
            last_id = new_last or last_id
            shown, ended = _pass_on(events, liveness, include_control)
            yield from shown
            if ended:
                return
            if not events and (error := liveness.verdict(self.live_workers())):
                self.abort(request_id)  # a worker that comes back later must not run it
                yield dict(error)
                return

    def read_output(self, request_id: str, count: int | None = None) -> list[dict]:
        """The events written so far (the batch collector reads finished streams whole)."""
        return _unpack([(None, self.r.xrange(protocol.output_stream(request_id), count=count))])[1]

    def delete_output(self, request_id: str) -> None:
        """Drop a finished request's output stream now instead of waiting for its expiry."""
        self.r.delete(protocol.output_stream(request_id))

    def has_output(self, request_id: str) -> bool:
        return bool(self.r.exists(protocol.output_stream(request_id)))

    # ------------------------------------------------------------ workers

    def live_workers(self) -> LiveWorkers:
        """Workers whose heartbeat key exists, with the names each serves; stale ids leave the set."""
        ids = sorted(_text(m) for m in self.r.smembers(protocol.WORKERS_SET))
        pipe = self.r.pipeline(transaction=False)
        for worker_id in ids:
            pipe.hmget(protocol.heartbeat_key(worker_id), LIVENESS_FIELDS)
        live = _live(ids, pipe.execute() if ids else [])
        stale = [w for w in ids if w not in live]
        if stale:
            self.r.srem(protocol.WORKERS_SET, *stale)
        return live

    def workers(self, max_age: float = 0.0) -> list[dict]:
        """Live workers' heartbeats (protocol.Heartbeat.as_dict()).

        max_age > 0 may answer from a snapshot up to that many seconds old (per-request callers on
        the hot path: three Redis round trips per API request otherwise).
        """
        taken, cached = self._workers_cache
        if max_age > 0 and time.monotonic() - taken < max_age:
            return cached
        ids = sorted(self.live_workers())
        pipe = self.r.pipeline(transaction=False)
        for worker_id in ids:
            pipe.hgetall(protocol.heartbeat_key(worker_id))
        found = [protocol.Heartbeat.from_fields(raw).as_dict() for raw in (pipe.execute() if ids else []) if raw]
        self._workers_cache = (time.monotonic(), found)
        return found

    def forget_workers_snapshot(self) -> None:
        """Tests that start and stop workers faster than the snapshot ages."""
        self._workers_cache = (float("-inf"), [])

    def block_maps(self) -> dict[str, object]:
        """worker_id -> the worker's latest engine.block_map() snapshot (published at most once a second)."""
        ids = sorted(self.live_workers())
        raws = self.r.mget([protocol.block_map_key(w) for w in ids]) if ids else []
        return {w: protocol.decode(raw) for w, raw in zip(ids, raws) if raw}

    def health(self) -> dict:
        """{"ok": at least one fresh heartbeat, "workers": [worker_id...], "redis": reachable}."""
        try:
            return _health(self.live_workers())
        except redis.RedisError as exc:
            return {"ok": False, "redis": False, "workers": [], "error": str(exc)}


# ---------------------------------------------------------------- the async client


class AsyncEngineClient:
    """Non-blocking client (ASGI views, Channels consumers): one per event loop.

    Its streams share the loop's StreamHub: one XREAD per engine step for all of them. Requests it
    will follow are submitted with its lease (lease_id, from lease()), refreshed while its event loop
    runs: when this process dies the lease lapses and the worker aborts them (batch requests carry
    none). Submitting itself is the sync client's, on the thread that admitted the request: one
    redis-py round trip there cost less than one on the event loop.
    """

    def __init__(self, r: aioredis.Redis):
        self.r = r
        self.lease_id = uuid.uuid4().hex
        self.leaser: asyncio.Task | None = None
        self.hub = StreamHub(self)

    def lease(self) -> str:
        """This event loop's lease id, for the requests it will follow (EngineClient.submit's
        lease_id): kept alive from now on for as long as the loop runs."""
        if self.leaser is None or self.leaser.done():
            self.leaser = asyncio.get_running_loop().create_task(self._keep_lease())
        return self.lease_id

    async def _keep_lease(self) -> None:
        """Refresh the lease for as long as this event loop runs (its own task, so a
        blocked XREAD or a busy stream never delays it)."""
        while True:
            await asyncio.sleep(protocol.LEASE_REFRESH_S)
            try:
                pipe = self.r.pipeline(transaction=False)
                _lease_ops(pipe, self.lease_id)
                await pipe.execute()
            except redis.RedisError:  # Redis away: streams hear it from the hub; refresh when it is back
                pass

    async def abort(self, request_id: str) -> None:
        pipe = self.r.pipeline(transaction=False)
        _abort_ops(pipe, request_id)
        await pipe.execute()

    async def stream(
        self,
        request_id: str,
        *,
        model: str | None = None,
        last_id: str = "0-0",
        timeout: float | None = None,
        no_worker_grace: float = NO_WORKER_GRACE_S,
        include_control: bool = False,
    ) -> AsyncIterator[dict]:
        """As EngineClient.stream."""
        liveness = Liveness(model, no_worker_grace=no_worker_grace, timeout=timeout)
        key = protocol.output_stream(request_id)
        inbox = await self.hub.subscribe(key, last_id)
        try:
            while True:
                batch = await inbox.get()
                if isinstance(batch, BaseException):
                    raise batch
                if isinstance(batch, _Tick):  # nothing for POLL_MS: is anyone still working on it?
                    if error := liveness.verdict(batch.live):
                        await self.abort(request_id)
                        yield dict(error)
                        return
                    continue
                shown, ended = _pass_on(batch, liveness, include_control)
                for event in shown:
                    yield event
                if ended:
                    return
        finally:
            self.hub.unsubscribe(key, inbox)

    async def live_workers(self) -> LiveWorkers:
        """As EngineClient.live_workers (read-only: the sync client prunes the set)."""
        ids = sorted(_text(m) for m in await self.r.smembers(protocol.WORKERS_SET))
        pipe = self.r.pipeline(transaction=False)
        for worker_id in ids:
            pipe.hmget(protocol.heartbeat_key(worker_id), LIVENESS_FIELDS)
        return _live(ids, await pipe.execute() if ids else [])

    async def workers(self) -> list[dict]:
        ids = sorted(await self.live_workers())
        pipe = self.r.pipeline(transaction=False)
        for worker_id in ids:
            pipe.hgetall(protocol.heartbeat_key(worker_id))
        return [protocol.Heartbeat.from_fields(raw).as_dict() for raw in (await pipe.execute() if ids else []) if raw]

    async def health(self) -> dict:
        try:
            return _health(await self.live_workers())
        except redis.RedisError as exc:
            return {"ok": False, "redis": False, "workers": [], "error": str(exc)}


class StreamHub:
    """Reads the output streams of every stream() of one AsyncEngineClient with a single blocking XREAD.

    Each stream() subscribes (a RequestSubscription: its output stream, its last entry id) and gets an
    asyncio queue of batches: a list of events per XREAD reply, a _Tick when its stream was quiet for
    POLL_MS (with the live workers, read once for all quiet streams), or the exception that stopped
    the reader. A subscription made while the XREAD blocks wakes it through the hub's own wake
    stream, so its first events are not held back until the block times out; a burst of
    subscriptions sends one wake, since the next XREAD names them all. Two subscriptions to one
    stream (a browser tab that reconnects) each get every entry after their own last id.

    The XREAD names the hot streams only (followed or written to in the last protocol.HUB_HOT_S) and
    the wake stream, which is also this lease's doorbell: a worker that writes to a stream quiet for
    protocol.RING_AFTER_S rings it with the request ids, and those streams are hot again for the next
    XREAD. A flood's backlog, a thousand streams waiting in an engine's queue, is then named only in the
    cold read every protocol.HUB_COLD_READ_S (streams of a worker that does not ring, or of another
    process's lease), not in every step's read (`query`).
    """

    def __init__(self, engine: AsyncEngineClient):
        self.engine = engine
        self.r = engine.r
        self.doorbell = protocol.hub_doorbell(engine.lease_id)
        self.doorbell_id = "0-0"  # the key is new: its first entry, whenever it comes, wakes the XREAD
        self.by_key: dict[str, dict[asyncio.Queue, RequestSubscription]] = {}
        self.hot: OrderedDict[str, float] = OrderedDict()  # stream key -> when last followed or written to
        self.cold_read_at = 0.0  # when an XREAD last named every followed stream
        self.reader: asyncio.Task | None = None
        self.wake_sent = False  # one wake per blocked XREAD: a burst of subscriptions must not re-read n times

    async def subscribe(self, key: str, last_id: str) -> asyncio.Queue:
        inbox: asyncio.Queue = asyncio.Queue()
        self.by_key.setdefault(key, {})[inbox] = RequestSubscription(_id_tuple(last_id), time.monotonic())
        self.touch(key, time.monotonic())
        if self.reader is None or self.reader.done():
            self.reader = asyncio.get_running_loop().create_task(self._read())
        elif not self.wake_sent:
            self.wake_sent = True
            pipe = self.r.pipeline(transaction=False)
            pipe.xadd(self.doorbell, {"w": "1"}, maxlen=protocol.DOORBELL_MAXLEN, approximate=True)
            pipe.expire(self.doorbell, protocol.OUTPUT_TTL_S)
            await pipe.execute()
        return inbox

    def unsubscribe(self, key: str, inbox: asyncio.Queue) -> None:
        subscriptions = self.by_key.get(key, {})
        subscriptions.pop(inbox, None)
        if not subscriptions:
            self.by_key.pop(key, None)
            self.hot.pop(key, None)

    def touch(self, key: str, now: float) -> None:
        """key was followed or written to now: hot for the next HUB_HOT_S."""
        self.hot[key] = now
        self.hot.move_to_end(key)

    def query(self, now: float) -> dict[KeyT, StreamIdT]:
        """The next XREAD's streams: the hot ones, and every one when the last cold read is HUB_COLD_READ_S old."""
        while self.hot and now - next(iter(self.hot.values())) >= protocol.HUB_HOT_S:
            self.hot.popitem(last=False)
        cold_read = now - self.cold_read_at >= protocol.HUB_COLD_READ_S
        if cold_read:
            self.cold_read_at = now
        query: dict[KeyT, StreamIdT] = {}
        for key in self.by_key if cold_read else self.hot:
            subscriptions = self.by_key[key]
            query[key] = "%d-%d" % min(sub.last_id for sub in subscriptions.values())
            for sub in subscriptions.values():
                sub.in_query = True
        return query

    async def _read(self) -> None:
        try:
            while self.by_key:
                self.wake_sent = False  # whoever subscribes after this query is built has to wake the XREAD
                query = self.query(time.monotonic())
                every_stream = len(query) == len(self.by_key)
                query[self.doorbell] = self.doorbell_id
                self._deliver(await self.r.xread(query, block=POLL_MS, count=256))
                if every_stream:  # the quiet ones are among the cold: look for them when those were read
                    await self._tick_quiet()
        except Exception as exc:  # Redis went away: every subscription hears it
            for subscriptions in self.by_key.values():
                for inbox in subscriptions:
                    inbox.put_nowait(exc)
            self.by_key.clear()

    def _deliver(self, reply) -> None:
        now = time.monotonic()
        for raw_key, items in reply or []:
            key = _text(raw_key)
            if key == self.doorbell:
                self.doorbell_id = _text(items[-1][0])
                self._answer_rings(items, now)
                continue
            if key in self.by_key:
                self.touch(key, now)
            for inbox, sub in self.by_key.get(key, {}).items():
                if not sub.in_query:  # joined during this XREAD, maybe behind its start: the next one reads its gap
                    continue
                mine = [(entry_id, fields) for entry_id, fields in items if _id_tuple(_text(entry_id)) > sub.last_id]
                if mine:
                    inbox.put_nowait(_unpack([(raw_key, mine)])[1])
                    sub.last_id, sub.seen = _id_tuple(_text(mine[-1][0])), now

    def _answer_rings(self, items, now: float) -> None:
        """The doorbell's entries: the streams a worker rang for are hot for the next XREAD."""
        for _entry_id, fields in items:
            for request_id in protocol.rung_request_ids(fields):
                key = protocol.output_stream(request_id)
                if key in self.by_key:
                    self.touch(key, now)

    async def _tick_quiet(self) -> None:
        now = time.monotonic()
        quiet = [
            (inbox, sub)
            for subscriptions in self.by_key.values()
            for inbox, sub in subscriptions.items()
            if now - sub.seen >= POLL_MS / 1000
        ]
        if not quiet:
            return
        tick = _Tick(await self.engine.live_workers())
        for inbox, sub in quiet:
            inbox.put_nowait(tick)
            sub.seen = now


@dataclass
class RequestSubscription:
    """One stream()'s place in the hub: how far its output stream has been read for it."""

    last_id: tuple[int, int]
    seen: float  # when it last got events or a tick
    in_query: bool = False  # the XREAD in flight started at or before last_id for this subscription


@dataclass
class _Tick:
    live: LiveWorkers


def _id_tuple(entry_id: str) -> tuple[int, int]:
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)


# ---------------------------------------------------------------- the clients of this process

_sync_client: EngineClient | None = None
_async_clients: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, AsyncEngineClient] = weakref.WeakKeyDictionary()


def client() -> EngineClient:
    global _sync_client
    if _sync_client is None:
        _sync_client = EngineClient(connections.sync_redis())
    return _sync_client


def aclient() -> AsyncEngineClient:
    """The running event loop's client, on that loop's connections (common.connections)."""
    loop = asyncio.get_running_loop()
    found = _async_clients.get(loop)
    if found is None:
        found = _async_clients[loop] = AsyncEngineClient(connections.async_redis())
    return found


def workers(max_age: float = 0.0) -> list[dict]:
    return client().workers(max_age)


def block_maps() -> dict[str, object]:
    return client().block_maps()
