"""The persistent engine worker: reads requests from Redis, steps the engine, streams deltas back.

Protocol (docs/protocol.md, key names and messages in inference/protocol.py): requests arrive on
one stream per served model name, read through a consumer group (several workers serving the
same model share it; a worker reads only the streams of the names it serves); each engine step
appends one entry per progressing request to that request's own output stream (bounded,
expiring); aborts arrive on a pub/sub channel (plus a key for requests
not yet read); a heartbeat hash with engine stats is refreshed every second with a TTL. A worker
reaps the pending requests of consumers whose heartbeat is gone, failing them with an error event.

This module is the loop (intake, aborts, steps) and the Redis transport; the events it sends are
made by output_processor.py (pure), the heartbeat and the reaping are membership.py's.
No Django here: the web tier and this loop share nothing but Redis.
"""

from __future__ import annotations

import gc
import logging
import os
import queue
import socket
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import redis

from inference import protocol
from inference.membership import Membership, request_id_of, text
from inference.output_processor import OutputProcessor, RequestState
from inference.pooling import PoolingParams
from inference.sampling_params import SamplingParams

log = logging.getLogger("tessera.worker")


class OutputWriter:
    """Sends every output pipeline (accepted events, a step's deltas, finishes, errors, XACKs) from a
    thread of its own, in order, so the next engine step runs while Redis takes this one's (Redis and
    the web process it wakes share the cores the engine fills; the cost is in docs/architecture.md).
    A failed write stops the worker at its next send or flush, as a synchronous one did."""

    def __init__(self):
        self._pipes: queue.Queue = queue.Queue()
        self._thread: threading.Thread | None = None
        self.error: Exception | None = None

    def send(self, pipe) -> None:
        self._raise_error()
        if self._thread is None:
            self._thread = threading.Thread(target=self._write, name="engine-output", daemon=True)
            self._thread.start()
        self._pipes.put(pipe)

    def flush(self) -> None:
        """Wait until everything sent so far is in Redis (before a write that must come after it)."""
        self._pipes.join()
        self._raise_error()

    def _raise_error(self) -> None:
        if self.error is not None:
            raise self.error

    def _write(self) -> None:
        while True:
            pipe = self._pipes.get()
            try:
                if self.error is None:
                    pipe.execute()
            except Exception as exc:  # kept for the main thread to raise: this thread must keep draining
                self.error = exc
            finally:
                self._pipes.task_done()


def inflight_factor(policy: str) -> int:
    """How many batches' worth of requests a worker reads from the stream by default. Requests left in
    the stream are read first come, first served, so `fair` can only order the backlog a worker holds:
    it holds four times more (each user's concurrency quota then bounds its share of that backlog). The
    price is that a burst is read by fewer workers."""
    return 8 if policy == "fair" else 2


@dataclass
class WorkerConfig:
    worker_id: str = ""
    model_name: str = ""  # the primary served name
    aliases: tuple[str, ...] = ()  # more names the same model answers to (vLLM's several served names)
    heartbeat_interval: float = 1.0
    heartbeat_ttl: float = 5.0
    idle_block_ms: int = 50  # XREADGROUP wait when the engine has nothing to do
    max_inflight: int = 0  # requests held at once; 0 = the engine's max_num_seqs x inflight_factor()
    output_maxlen: int = 10_000  # entries kept per output stream
    output_ttl: int = 3600  # seconds an output stream lives after its last write
    stream_interval: int = 1  # tokens per delta while running (vLLM's --stream-interval); first and last go at once
    reap_interval: float = 2.0
    drain_timeout: float = 30.0  # on SIGTERM, how long in-flight requests may finish
    extra_info: dict = field(default_factory=dict)  # published in the heartbeat's config field
    freeze_heap: bool = False  # the process is this worker's own (manage.py engine): see setup()

    @property
    def served_model_names(self) -> list[str]:
        return list(dict.fromkeys([self.model_name, *self.aliases]))


class EngineWorker:
    """Serve one engine (inference LLMEngine) over Redis. run() loops until stop() is called."""

    def __init__(self, engine, redis_client: redis.Redis, config: WorkerConfig | None = None):
        self.engine = engine
        self.r = redis_client
        self.config = config or WorkerConfig()
        self.worker_id = self.config.worker_id or f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.states: dict[str, RequestState] = {}
        self.counters = {"requests_total": 0, "aborts_total": 0, "errors_total": 0, "steps_total": 0}
        self._stopping = threading.Event()
        self._draining = False
        self._last_lease_check = 0.0
        self._step_ms = 0.0
        self._pubsub: redis.client.PubSub | None = None
        self.output = OutputWriter()
        self._rings: dict[str, list[str]] = {}  # lease id -> requests whose quiet streams the next send writes to
        self.processor = OutputProcessor(engine.tokenizer, stream_interval=self.config.stream_interval)
        self.membership = Membership(
            self.r,
            engine,
            worker_id=self.worker_id,
            model_name=self.config.model_name,
            served_model_names=self.config.served_model_names,
            request_streams=self.request_streams,
            extra_info=self.config.extra_info,
            heartbeat_interval=self.config.heartbeat_interval,
            heartbeat_ttl=self.config.heartbeat_ttl,
            reap_interval=self.config.reap_interval,
            stopping=self._stopping,
            loop_stats=self._loop_stats,
            end_early=self._end_early,
        )
        self.max_inflight = (
            self.config.max_inflight or inflight_factor(self._policy_name()) * self._engine_max_num_seqs()
        )

    # ------------------------------------------------------------ lifecycle

    def _engine_max_num_seqs(self) -> int:
        for holder in (
            getattr(self.engine, "args", None),
            getattr(self.engine, "engine_args", None),
            getattr(self.engine, "config", None),
        ):
            value = getattr(holder, "max_num_seqs", None)
            if isinstance(value, int):
                return value
        return 128

    def _policy_name(self) -> str:
        scheduler = getattr(self.engine, "scheduler", None)
        return getattr(getattr(scheduler, "policy", None), "name", "fcfs")

    @property
    def request_streams(self) -> list[str]:
        """The request streams of every name this worker serves: it never reads another model's."""
        return [protocol.request_stream(name) for name in self.config.served_model_names]

    def _loop_stats(self) -> dict:
        """The loop's own figures for the heartbeat, beside the engine's."""
        return {
            **self.counters,
            "inflight": len(self.states),
            "step_ms": round(self._step_ms, 3),
            "last_step_at": time.time(),
            "draining": self._draining,
        }

    def setup(self) -> None:
        for stream in self.request_streams:
            try:
                self.r.xgroup_create(stream, protocol.CONSUMER_GROUP, id="0", mkstream=True)
            except redis.ResponseError as exc:
                if "BUSYGROUP" not in str(exc):
                    raise
        self._pubsub = pubsub = self.r.pubsub(ignore_subscribe_messages=True)
        pubsub.subscribe(protocol.ABORT_CHANNEL)
        # Before the first heartbeat: what loads on first use must not be the first request's wait.
        getattr(self.engine, "warm_up", lambda: None)()
        if self.config.freeze_heap:
            # What start-up allocated lives as long as the process: out of the collector's sight, a full
            # collection walks only what serving allocates, instead of pausing the steps for all of it.
            gc.collect()
            gc.freeze()
        self.membership.join()
        log.info("engine worker %s serving %s", self.worker_id, ", ".join(self.config.served_model_names))

    def stop(self, drain: bool = True) -> None:
        """Stop reading new requests; in-flight ones finish (drain) or fail at once."""
        self._draining = True
        if not drain:
            self._stopping.set()

    def run(self) -> None:
        self.setup()
        drain_deadline = None
        try:
            while not self._stopping.is_set():
                if self._draining:
                    drain_deadline = drain_deadline or time.monotonic() + self.config.drain_timeout
                    if not self.states or time.monotonic() > drain_deadline:
                        break
                self.run_once()
        finally:
            self.shutdown()

    def shutdown(self) -> None:
        self._stopping.set()
        self.fail_all("worker_shutdown", "the engine worker shut down before this request finished")
        try:
            self.output.flush()  # the last step's finishes, before this process goes
        except redis.RedisError as exc:
            log.warning("the last outputs could not be written: %s", exc)
        self.membership.leave()
        if self._pubsub is not None:
            self._pubsub.close()
        getattr(self.engine, "shutdown", lambda: None)()  # stops tensor-parallel ranks, if any
        log.info("engine worker %s stopped", self.worker_id)

    # ------------------------------------------------------------ one iteration

    def run_once(self) -> None:
        """Read new requests, apply aborts, run one engine step and publish its deltas."""
        busy = self.engine.has_unfinished_requests()
        if not self._draining:
            self.read_requests(block_ms=None if busy else self.config.idle_block_ms)
        self.apply_aborts()
        if time.monotonic() - self._last_lease_check >= self.config.heartbeat_interval:
            self._last_lease_check = time.monotonic()
            self.abort_lapsed_leases()
        if self.engine.has_unfinished_requests():
            self.step()
        self.membership.take_snapshot()
        self.membership.reap_when_due()

    def read_requests(self, block_ms: int | None) -> None:
        room = self.max_inflight - len(self.states)
        if room <= 0:
            if block_ms:
                time.sleep(block_ms / 1000)
            return
        reply: Any = self.r.xreadgroup(
            protocol.CONSUMER_GROUP, self.worker_id, {s: ">" for s in self.request_streams}, count=room, block=block_ms
        )
        entries = [(text(stream), text(eid), fields) for stream, items in reply or [] for eid, fields in items]
        if not entries:
            return
        pipe = self.r.pipeline(transaction=False)
        for _stream, entry_id, fields in entries:
            pipe.exists(protocol.aborted_key(request_id_of(fields, entry_id)))
        aborted = pipe.execute()
        out = self.r.pipeline(transaction=False)
        for (stream, entry_id, fields), was_aborted in zip(entries, aborted):
            self.accept(stream, entry_id, fields, bool(was_aborted), out)
        self._send(out)  # ahead of these requests' first deltas; the step need not wait for it

    def accept(self, stream: str, entry_id: str, fields: dict, was_aborted: bool, pipe) -> None:
        """Hand one request to the engine, or answer it at once (aborted, expired, invalid)."""
        self.counters["requests_total"] += 1
        try:
            request = protocol.EngineRequest.from_fields(fields)
        except (ValueError, TypeError, KeyError) as exc:
            error = protocol.error_event("invalid_request", f"bad message: {exc}")
            return self._end_early(pipe, stream, entry_id, request_id_of(fields, entry_id), error)
        if was_aborted:
            self.counters["aborts_total"] += 1
            return self._end_early(
                pipe, stream, entry_id, request.request_id, protocol.finish_event(["abort"], protocol.empty_usage(), {})
            )
        if request.deadline and time.time() > request.deadline:
            return self._end_early(
                pipe,
                stream,
                entry_id,
                request.request_id,
                protocol.error_event("expired", "the request waited in the queue past its deadline"),
            )
        try:
            params = self._engine_params(request)
            prompt = (
                {"prompt_token_ids": request.prompt_token_ids}
                if request.prompt_token_ids is not None
                else request.prompt
            )
            tenant = None if request.tenant is None else str(request.tenant)
            self.engine.add_request(
                request.request_id, prompt, params, priority=int(request.priority), tenant=tenant, weight=request.weight
            )
        except (ValueError, TypeError, KeyError) as exc:
            error = protocol.error_event("invalid_request", str(exc))
            return self._end_early(pipe, stream, entry_id, request.request_id, error)
        state = RequestState(
            request.request_id,
            entry_id,
            n=params.n,
            stream=stream,
            want_logprobs=params.logprobs,
            want_prompt_logprobs=params.prompt_logprobs,
            submitted_at=request.submitted_at or None,
        )
        state.prompt_tokens = self._prompt_len(request)
        state.lease_id = request.lease_id
        self.states[request.request_id] = state
        self._emit(pipe, request.request_id, [protocol.accepted_event(self.worker_id, state.prompt_tokens)], state)

    def _engine_params(self, request: protocol.EngineRequest):
        """SamplingParams for a generation, PoolingParams for an embedding; ValueError when this engine's
        model does the other task (its tokenizer and its outputs would not fit the request)."""
        embeds = getattr(self.engine, "task", "generate") == protocol.EMBED_TASK
        if (request.pooling_params is not None) != embeds:
            raise ValueError(
                f"model {request.model!r} is an embedding model: use /v1/embeddings"
                if embeds
                else f"model {request.model!r} generates text; it does not make embeddings"
            )
        if embeds:
            return PoolingParams(**(request.pooling_params or {}))
        return SamplingParams(**request.sampling_params)

    def _prompt_len(self, request: protocol.EngineRequest) -> int:
        if request.prompt_token_ids is not None:
            return len(request.prompt_token_ids)
        return len(self.engine.tokenizer.encode(request.prompt))

    def _end_early(self, pipe, stream: str, entry_id: str, request_id: str, event: protocol.Event) -> None:
        """Answer a request the engine never saw with its one terminal event."""
        if event["type"] == "error":
            self.counters["errors_total"] += 1
        self._emit(pipe, request_id, [event])
        pipe.xack(stream, protocol.CONSUMER_GROUP, entry_id)

    def _end(self, pipe, state: RequestState, event: protocol.Event) -> None:
        """The terminal event of a request the engine held, and its XACK."""
        self._emit(pipe, state.request_id, [event], state)
        pipe.xack(state.stream, protocol.CONSUMER_GROUP, state.entry_id)

    def _emit(self, pipe, request_id: str, events: list[protocol.Event], state: RequestState | None = None) -> None:
        """XADD the events; EXPIRE too, except on a running request's deltas while its TTL is fresh
        (one command instead of two per request per step). A leased stream quiet for RING_AFTER_S gets
        its lease's doorbell rung when the pipeline is sent (_send)."""
        key = protocol.output_stream(request_id)
        pipe.xadd(key, protocol.output_fields(events), maxlen=self.config.output_maxlen, approximate=True)
        now = time.monotonic()
        if state is None or now - state.ttl_set_at > self.config.output_ttl / 4 or events[-1]["type"] != "delta":
            pipe.expire(key, self.config.output_ttl)
            if state is not None:
                state.ttl_set_at = now
        if state is not None:
            if state.lease_id and now - state.written_at >= protocol.RING_AFTER_S:
                self._rings.setdefault(state.lease_id, []).append(request_id)
            state.written_at = now

    def _send(self, pipe) -> None:
        """Hand pipe to the output thread, ending with one doorbell entry per lease it rings, so a hub
        reads the streams it names only after their events are in."""
        for lease_id, request_ids in self._rings.items():
            doorbell = protocol.hub_doorbell(lease_id)
            pipe.xadd(doorbell, protocol.ring_fields(request_ids), maxlen=protocol.DOORBELL_MAXLEN, approximate=True)
            pipe.expire(doorbell, protocol.OUTPUT_TTL_S)
        self._rings.clear()
        self.output.send(pipe)

    # ------------------------------------------------------------ aborts

    def apply_aborts(self) -> None:
        while True:
            assert self._pubsub is not None, "setup() subscribes first"
            message = self._pubsub.get_message(timeout=0.0)
            if message is None:
                return
            if message.get("type") != "message":
                continue
            request_id = text(message["data"])
            if request_id in self.states:
                self.abort(request_id)

    def abort_lapsed_leases(self) -> None:
        """Abort the requests whose web process stopped following them (its lease lapsed)."""
        lease_ids = sorted({state.lease_id for state in self.states.values() if state.lease_id})
        if not lease_ids:
            return
        pipe = self.r.pipeline(transaction=False)
        for lease_id in lease_ids:
            pipe.exists(protocol.lease_key(lease_id))
        gone = {lease_id for lease_id, alive in zip(lease_ids, pipe.execute()) if not alive}
        for request_id in [rid for rid, state in self.states.items() if state.lease_id in gone]:
            log.warning("aborting %s: its web process stopped following it", request_id)
            self.abort(request_id)

    def abort(self, request_id: str) -> None:
        """Abort in the engine (frees its blocks now) and end the stream with finish_reason 'abort'."""
        state = self.states.pop(request_id)
        self.engine.abort_request(request_id)
        self.counters["aborts_total"] += 1
        pipe = self.r.pipeline(transaction=False)
        self._end(pipe, state, self.processor.abort_event(state))
        self._send(pipe)
        self.output.flush()  # the stream has ended when abort returns

    # ------------------------------------------------------------ stepping

    def step(self) -> None:
        started = time.perf_counter()
        try:
            outputs = self.engine.step()
        except Exception as exc:  # one broken batch must not kill the worker and strand every client
            log.exception("engine step failed")
            self.fail_all("engine_error", f"engine step failed: {exc}")
            if getattr(exc, "fatal", False):  # e.g. a dead tensor-parallel rank: the engine cannot go on
                raise
            return
        self.counters["steps_total"] += 1
        pipe = self.r.pipeline(transaction=False)
        for output in outputs:
            state = self.states.get(output.request_id)
            if state is not None:
                self.publish_output(pipe, state, output)
        self._send(pipe)
        elapsed = (time.perf_counter() - started) * 1000
        self._step_ms = 0.9 * self._step_ms + 0.1 * elapsed if self._step_ms else elapsed

    def publish_output(self, pipe, state: RequestState, output) -> None:
        """One XADD with this step's events of the request; once it ended, its XACK too."""
        events = self.processor.events(state, output)
        if not events:
            return
        if events[-1]["type"] in protocol.TERMINAL_EVENTS:
            self.states.pop(state.request_id, None)
            if events[-1]["type"] == "error":
                self.counters["errors_total"] += 1
            pipe.xack(state.stream, protocol.CONSUMER_GROUP, state.entry_id)
        self._emit(pipe, state.request_id, events, state)

    def fail_all(self, code: str, message: str) -> None:
        """End every in-flight request with an error event and drop it from the engine."""
        if not self.states:
            return
        pipe = self.r.pipeline(transaction=False)
        for request_id, state in list(self.states.items()):
            try:
                self.engine.abort_request(request_id)
            except Exception:  # the engine may already be broken; the client must still be told
                log.exception("abort of %s failed", request_id)
            self._end(pipe, state, protocol.error_event(code, message))
            self.counters["errors_total"] += 1
        self.states.clear()
        try:
            self._send(pipe)
            self.output.flush()
        except redis.RedisError:
            log.exception("could not publish %s errors", code)
