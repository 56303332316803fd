"""The persistent engine worker: reads requests from Redis, steps the engine, streams deltas back.

Protocol (docs/protocol.md, key names and messages in inference/protocol.py): requests arrive on
one stream per served model name, read through a consumer group (several workers serving the
same model share it; a worker reads only the streams of the names it serves); each engine step
appends one entry per progressing request to that request's own output stream (bounded,
expiring); aborts arrive on a pub/sub channel (plus a key for requests
not yet read); a heartbeat hash with engine stats is refreshed every second with a TTL. A worker
reaps the pending requests of consumers whose heartbeat is gone, failing them with an error event.

No Django here: the web tier and this loop share nothing but Redis.
"""
from __future__ import annotations

import logging
import os
import queue
import socket
import threading
import time
import uuid
from dataclasses import dataclass, field

import redis

from inference import protocol as p
from inference.sampling_params import SamplingParams

log = logging.getLogger("tessera.worker")


class OutputWriter:
    """Sends every output pipeline (accepted events, a step's deltas, finishes, errors, XACKs) from a
    thread of its own, in order, so the next engine step runs while Redis takes this one's: waiting
    for that reply took 1.1 ms of every 6.5 ms step at 4 requests/s on a 2-core host (Redis and the
    web process it wakes share the cores the engine fills). A failed write stops the worker at its
    next send or flush, as a synchronous one did."""

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


@dataclass
class WorkerConfig:
    worker_id: str = ""
    model_name: str = ""  # the primary served name
    aliases: tuple[str, ...] = ()  # more names the same model answers to (vLLM's several served names)
    heartbeat_interval: float = 1.0
    heartbeat_ttl: float = 5.0
    idle_block_ms: int = 50  # XREADGROUP wait when the engine has nothing to do
    max_inflight: int = 0  # requests held at once; 0 = 2 * the engine's max_num_seqs
    output_maxlen: int = 10_000  # entries kept per output stream
    output_ttl: int = 3600  # seconds an output stream lives after its last write
    stream_interval: int = 1  # tokens per delta while running (vLLM's --stream-interval); first and last go at once
    reap_interval: float = 2.0
    drain_timeout: float = 30.0  # on SIGTERM, how long in-flight requests may finish
    extra_info: dict = field(default_factory=dict)  # published in the heartbeat's config field

    @property
    def served_model_names(self) -> list[str]:
        return list(dict.fromkeys([self.model_name, *self.aliases]))


@dataclass
class RequestState:
    request_id: str
    entry_id: str
    n: int
    stream: str = ""  # the request stream it came from (where it is XACKed)
    prompt_tokens: int = 0
    want_logprobs: int | None = None
    want_prompt_logprobs: int | None = None
    prompt_logprobs_sent: bool = False
    submitted_at: float | None = None
    received_at: float = field(default_factory=time.time)
    first_token_at: float | None = None
    sent_len: list[int] = field(default_factory=list)  # characters of text already sent per choice
    sent_ids: list[int] = field(default_factory=list)  # tokens already sent per choice
    finished: list[bool] = field(default_factory=list)
    finish_reasons: list[str | None] = field(default_factory=list)
    cached_tokens: int = 0
    num_preemptions: int = 0
    ttl_set_at: float = 0.0  # monotonic time of the output stream's last EXPIRE
    follower: str | None = None  # the web process's lease (protocol.follower_lease_key); None: not leased

    def __post_init__(self):
        self.sent_len = [0] * self.n
        self.sent_ids = [0] * self.n
        self.finished = [False] * self.n
        self.finish_reasons = [None] * self.n

    @property
    def completion_tokens(self) -> int:
        return sum(self.sent_ids)

    def usage(self) -> dict:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "cached_tokens": self.cached_tokens}

    def metrics(self) -> dict:
        now = time.time()
        queue_ms = None if self.submitted_at is None else max(0.0, (self.received_at - self.submitted_at) * 1000)
        ttft_ms = None if self.first_token_at is None else (self.first_token_at - self.received_at) * 1000
        return {"queue_ms": queue_ms, "ttft_ms": ttft_ms, "latency_ms": (now - self.received_at) * 1000,
                "num_preemptions": self.num_preemptions}


class EngineWorker:
    """Serve one engine (inference LLMEngine) over Redis. run() loops until stop() is called."""

    def __init__(self, engine, redis_client: redis.Redis, config: WorkerConfig | None = None):
        self.engine = engine
        self.r = redis_client
        self.config = config or WorkerConfig()
        self.worker_id = self.config.worker_id or f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.states: dict[str, RequestState] = {}
        self.counters = {"requests_total": 0, "aborts_total": 0, "errors_total": 0, "steps_total": 0}
        self.started_at = time.time()
        self._stopping = threading.Event()
        self._draining = False
        self._snapshot: dict = {}
        self._snapshot_at = 0.0
        self._block_map = None
        self._last_reap = 0.0
        self._last_lease_check = 0.0
        self._step_ms = 0.0
        self._pubsub = None
        self._heartbeat_thread: threading.Thread | None = None
        self.output = OutputWriter()
        self.max_inflight = self.config.max_inflight or 2 * self._engine_max_num_seqs()

    # ------------------------------------------------------------ lifecycle

    def _engine_max_num_seqs(self) -> int:
        for holder in (getattr(self.engine, "args", None), getattr(self.engine, "engine_args", None),
                       getattr(self.engine, "config", None)):
            value = getattr(holder, "max_num_seqs", None)
            if isinstance(value, int):
                return value
        return 128

    @property
    def request_streams(self) -> list[str]:
        """The request streams of every name this worker serves: it never reads another model's."""
        return [p.request_stream(name) for name in self.config.served_model_names]

    def setup(self) -> None:
        for stream in self.request_streams:
            try:
                self.r.xgroup_create(stream, p.CONSUMER_GROUP, id="0", mkstream=True)
            except redis.ResponseError as exc:
                if "BUSYGROUP" not in str(exc):
                    raise
        self._pubsub = self.r.pubsub(ignore_subscribe_messages=True)
        self._pubsub.subscribe(p.ABORT_CHANNEL)
        self._take_snapshot(force=True)
        self.publish_heartbeat()
        self._heartbeat_thread = threading.Thread(target=self._heartbeat_loop, name="heartbeat", daemon=True)
        self._heartbeat_thread.start()
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
        if self._heartbeat_thread:
            self._heartbeat_thread.join(timeout=2)
        pipe = self.r.pipeline(transaction=False)
        pipe.delete(p.heartbeat_key(self.worker_id), p.block_map_key(self.worker_id))
        pipe.srem(p.WORKERS_SET, self.worker_id)
        for stream in self.request_streams:
            pipe.xgroup_delconsumer(stream, p.CONSUMER_GROUP, self.worker_id)
        try:
            pipe.execute()
        except redis.RedisError as exc:
            log.warning("clean-up on shutdown failed: %s", exc)
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
            self.abort_unfollowed()
        if self.engine.has_unfinished_requests():
            self.step()
        self._take_snapshot()
        if time.monotonic() - self._last_reap > self.config.reap_interval:
            self._last_reap = time.monotonic()
            self.reap_dead_workers()

    def read_requests(self, block_ms: int | None) -> None:
        room = self.max_inflight - len(self.states)
        if room <= 0:
            if block_ms:
                time.sleep(block_ms / 1000)
            return
        reply = self.r.xreadgroup(p.CONSUMER_GROUP, self.worker_id, {s: ">" for s in self.request_streams},
                                  count=room, block=block_ms)
        entries = [(_text(stream), _text(eid), fields) for stream, items in reply or [] for eid, fields in items]
        if not entries:
            return
        pipe = self.r.pipeline(transaction=False)
        for _stream, entry_id, fields in entries:
            pipe.exists(p.aborted_key(_request_id(fields, entry_id)))
        aborted = pipe.execute()
        out = self.r.pipeline(transaction=False)
        for (stream, entry_id, fields), was_aborted in zip(entries, aborted):
            self.accept(stream, entry_id, fields, bool(was_aborted), out)
        self.output.send(out)  # ahead of these requests' first deltas; the step need not wait for it

    def accept(self, stream: str, entry_id: str, fields: dict, was_aborted: bool, pipe) -> None:
        """Hand one request to the engine, or answer it at once (aborted, expired, invalid)."""
        self.counters["requests_total"] += 1
        try:
            request = p.EngineRequest.from_fields(fields)
        except (ValueError, TypeError, KeyError) as exc:
            error = p.error_event("invalid_request", f"bad message: {exc}")
            return self._end_early(pipe, stream, entry_id, _request_id(fields, entry_id), error)
        if was_aborted:
            self.counters["aborts_total"] += 1
            return self._end_early(pipe, stream, entry_id, request.request_id,
                                   p.finish_event(["abort"], p.empty_usage(), {}))
        if request.deadline and time.time() > request.deadline:
            return self._end_early(pipe, stream, entry_id, request.request_id, p.error_event(
                "expired", "the request waited in the queue past its deadline"))
        try:
            params = SamplingParams(**request.sampling_params)
            prompt = ({"prompt_token_ids": request.prompt_token_ids}
                      if request.prompt_token_ids is not None else request.prompt)
            self.engine.add_request(request.request_id, prompt, params, priority=int(request.priority))
        except (ValueError, TypeError, KeyError) as exc:
            error = p.error_event("invalid_request", str(exc))
            return self._end_early(pipe, stream, entry_id, request.request_id, error)
        state = RequestState(request.request_id, entry_id, n=params.n, stream=stream, want_logprobs=params.logprobs,
                             want_prompt_logprobs=params.prompt_logprobs, submitted_at=request.submitted_at or None)
        state.prompt_tokens = self._prompt_len(request)
        state.follower = request.follower
        self.states[request.request_id] = state
        self._emit(pipe, request.request_id, [p.accepted_event(self.worker_id, state.prompt_tokens)], state)

    def _prompt_len(self, request: p.EngineRequest) -> int:
        if request.prompt_token_ids is not None:
            return len(request.prompt_token_ids)
        return len(self.engine.tokenizer.encode(request.prompt))

    def _end_early(self, pipe, stream: str, entry_id: str, request_id: str, event: dict) -> None:
        """Answer a request the engine never saw with its one terminal event."""
        if event["type"] == "error":
            self.counters["errors_total"] += 1
        self._emit(pipe, request_id, [event])
        pipe.xack(stream, p.CONSUMER_GROUP, entry_id)

    def _end(self, pipe, state: RequestState, event: dict) -> None:
        """The terminal event of a request the engine held, and its XACK."""
        self._emit(pipe, state.request_id, [event])
        pipe.xack(state.stream, p.CONSUMER_GROUP, state.entry_id)

    def _emit(self, pipe, request_id: str, events: list[dict], state: RequestState | None = None) -> None:
        """XADD the events; EXPIRE too, except on a running request's deltas while its TTL is fresh
        (one command instead of two per request per step)."""
        key = p.output_stream(request_id)
        pipe.xadd(key, p.output_fields(events), maxlen=self.config.output_maxlen, approximate=True)
        now = time.monotonic()
        if state is None or now - state.ttl_set_at > self.config.output_ttl / 4 or events[-1]["type"] != "delta":
            pipe.expire(key, self.config.output_ttl)
            if state is not None:
                state.ttl_set_at = now

    # ------------------------------------------------------------ aborts

    def apply_aborts(self) -> None:
        while True:
            message = self._pubsub.get_message(timeout=0.0)
            if message is None:
                return
            if message.get("type") != "message":
                continue
            request_id = _text(message["data"])
            if request_id in self.states:
                self.abort(request_id)

    def abort_unfollowed(self) -> None:
        """Abort the requests whose web process stopped following them (its follower lease lapsed)."""
        followers = sorted({state.follower for state in self.states.values() if state.follower})
        if not followers:
            return
        pipe = self.r.pipeline(transaction=False)
        for follower in followers:
            pipe.exists(p.follower_lease_key(follower))
        gone = {follower for follower, alive in zip(followers, pipe.execute()) if not alive}
        for request_id in [rid for rid, state in self.states.items() if state.follower in gone]:
            log.warning("aborting %s: its web process stopped following it", request_id)
            self.abort(request_id)

    def abort(self, request_id: str) -> None:
        """Abort in the engine (frees its blocks now) and end the stream with finish_reason 'abort'."""
        state = self.states.pop(request_id)
        self.engine.abort_request(request_id)
        self.counters["aborts_total"] += 1
        reasons = [r or "abort" for r in state.finish_reasons]
        pipe = self.r.pipeline(transaction=False)
        self._end(pipe, state, p.finish_event(reasons, state.usage(), state.metrics()))
        self.output.send(pipe)
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
        self.output.send(pipe)
        elapsed = (time.perf_counter() - started) * 1000
        self._step_ms = 0.9 * self._step_ms + 0.1 * elapsed if self._step_ms else elapsed

    def publish_output(self, pipe, state: RequestState, output) -> None:
        """One XADD with this step's delta of every choice; on finish the usage and an XACK."""
        if getattr(output, "error", None):
            self.states.pop(state.request_id, None)
            self.counters["errors_total"] += 1
            self._end(pipe, state, p.error_event("engine_error", output.error))
            return
        state.cached_tokens = output.num_cached_tokens or 0
        state.prompt_tokens = len(output.prompt_token_ids) or state.prompt_tokens
        if output.metrics is not None:
            state.num_preemptions = output.metrics.num_preemptions
        if not output.finished and not self._delta_due(state, output.outputs):
            return
        events = [e for c in output.outputs if (e := self._delta(state, c)) is not None]
        if (prompt_event := self._prompt_logprobs(state, output)) is not None:
            events.insert(0, prompt_event)
        if output.finished:
            self.states.pop(state.request_id, None)
            events.append(p.finish_event(state.finish_reasons, state.usage(), state.metrics()))
            pipe.xack(state.stream, p.CONSUMER_GROUP, state.entry_id)
        if events:
            self._emit(pipe, state.request_id, events, state)

    def _delta_due(self, state: RequestState, completions) -> bool:
        """With stream_interval k, a running request's tokens go out k at a time (fewer, larger
        deltas: less work per token for Redis and the web tier); the first token never waits."""
        k = self.config.stream_interval
        if k <= 1 or state.first_token_at is None:
            return True
        return any(c.finish_reason is not None or len(c.token_ids) - state.sent_ids[c.index] >= k
                   for c in completions if c.index < state.n and not state.finished[c.index])

    def _delta(self, state: RequestState, completion) -> dict | None:
        i = completion.index
        if i >= state.n or state.finished[i]:
            return None
        new_ids = completion.token_ids[state.sent_ids[i]:]
        new_text = completion.text[state.sent_len[i]:]
        finished = completion.finish_reason is not None
        if not new_ids and not new_text and not finished:
            return None
        event = p.delta_event(i, new_text, list(new_ids), completion.finish_reason, completion.stop_reason)
        if state.want_logprobs is not None and completion.logprobs is not None:
            event["logprobs"] = self._logprobs(completion, state.sent_ids[i], len(completion.token_ids), state.want_logprobs)
        if new_ids and state.first_token_at is None:
            state.first_token_at = time.time()
        state.sent_ids[i] = len(completion.token_ids)
        state.sent_len[i] = max(state.sent_len[i], len(completion.text))
        state.finished[i] = finished
        state.finish_reasons[i] = completion.finish_reason
        return event

    def _logprobs(self, completion, start: int, end: int, top_n: int) -> list[dict]:
        return [self._logprob_entry(completion.token_ids[pos], completion.logprobs[pos], top_n)
                for pos in range(start, min(end, len(completion.logprobs)))]

    def _prompt_logprobs(self, state: RequestState, output) -> dict | None:
        """The prompt's logprobs, once, as soon as the engine has them for every prompt token."""
        entries, prompt = output.prompt_logprobs, output.prompt_token_ids
        if state.want_prompt_logprobs is None or state.prompt_logprobs_sent or entries is None:
            return None
        if len(entries) < len(prompt):
            return None
        state.prompt_logprobs_sent = True
        first = {"token_id": prompt[0], "token": self._token_text(prompt[0], None), "logprob": None, "top": []}
        return p.prompt_logprobs_event([first] + [self._logprob_entry(token_id, candidates, state.want_prompt_logprobs)
                                                  for token_id, candidates in zip(prompt[1:], entries[1:])])

    def _logprob_entry(self, token_id: int, candidates, top_n: int) -> dict:
        candidates = candidates or {}
        chosen = candidates.get(token_id)
        ranked = sorted(candidates.items(), key=lambda kv: kv[1].rank)[:top_n]
        return {
            "token_id": token_id,
            "token": self._token_text(token_id, chosen),
            "logprob": chosen.logprob if chosen is not None else None,
            "top": [{"token_id": tid, "token": self._token_text(tid, lp), "logprob": lp.logprob} for tid, lp in ranked],
        }

    def _token_text(self, token_id: int, logprob) -> str:
        if logprob is not None and logprob.decoded_token is not None:
            return logprob.decoded_token
        return self.engine.tokenizer.decode([token_id])

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
            self._end(pipe, state, p.error_event(code, message))
            self.counters["errors_total"] += 1
        self.states.clear()
        try:
            self.output.send(pipe)
            self.output.flush()
        except redis.RedisError:
            log.exception("could not publish %s errors", code)

    # ------------------------------------------------------------ dead workers

    def reap_dead_workers(self) -> int:
        """Fail the pending requests of consumers without a heartbeat (a worker that died mid-request)."""
        reaped = 0
        for stream in self.request_streams:
            try:
                consumers = self.r.xinfo_consumers(stream, p.CONSUMER_GROUP)
            except redis.ResponseError:
                continue
            for consumer in consumers:
                name = _text(consumer["name"])
                if name == self.worker_id or self.r.exists(p.heartbeat_key(name)):
                    continue
                reaped += self._reap_consumer(stream, name, int(consumer.get("pending", 0)))
        return reaped

    def _reap_consumer(self, stream: str, name: str, pending: int) -> int:
        reaped = 0
        if pending:
            rows = self.r.xpending_range(stream, p.CONSUMER_GROUP, min="-", max="+", count=pending, consumername=name)
            ids = [row["message_id"] for row in rows]
            # XCLAIM with a min idle time: of two surviving workers only one wins each entry.
            claimed = self.r.xclaim(stream, p.CONSUMER_GROUP, self.worker_id, min_idle_time=500,
                                    message_ids=ids) if ids else []
            pipe = self.r.pipeline(transaction=False)
            for entry_id, fields in claimed:
                if not fields:
                    continue
                event = p.error_event("worker_lost", f"engine worker {name} died while running this request")
                self._end_early(pipe, stream, _text(entry_id), _request_id(fields, _text(entry_id)), event)
                reaped += 1
            pipe.execute()
        still = self.r.xpending_range(stream, p.CONSUMER_GROUP, min="-", max="+", count=1, consumername=name)
        if not still:
            self.r.xgroup_delconsumer(stream, p.CONSUMER_GROUP, name)
            self.r.srem(p.WORKERS_SET, name)
        if reaped:
            log.warning("failed %d requests of dead worker %s", reaped, name)
        return reaped

    # ------------------------------------------------------------ heartbeat

    def _take_snapshot(self, force: bool = False) -> None:
        """Copy engine stats and the block map for the heartbeat thread (only this thread touches the engine)."""
        now = time.monotonic()
        if not force and now - self._snapshot_at < self.config.heartbeat_interval / 2:
            return
        self._snapshot_at = now
        stats = dict(self.engine.get_stats())
        stats.update(self.counters)
        stats.update({"inflight": len(self.states), "step_ms": round(self._step_ms, 3),
                      "last_step_at": time.time(), "draining": self._draining})
        metrics = getattr(self.engine, "metrics", None)
        if metrics is not None:  # histograms for /metrics, copied here: the engine's thread updates them
            stats["engine_metrics"] = metrics.snapshot()
        self._snapshot = stats
        block_map = getattr(self.engine, "block_map", None)
        if block_map is not None:
            self._block_map = block_map()

    def _heartbeat_loop(self) -> None:
        while not self._stopping.wait(self.config.heartbeat_interval):
            try:
                self.publish_heartbeat()
            except redis.RedisError as exc:
                log.warning("heartbeat failed: %s", exc)

    def publish_heartbeat(self) -> None:
        stats = dict(self._snapshot)
        stats["tokens_per_s"] = self._tokens_per_s(stats)
        now = time.time()
        ttl_ms = int(self.config.heartbeat_ttl * 1000)
        key = p.heartbeat_key(self.worker_id)
        heartbeat = p.Heartbeat(worker_id=self.worker_id, model=self.config.model_name,
                                served_model_names=self.config.served_model_names, pid=os.getpid(),
                                host=socket.gethostname(), started_at=self.started_at, updated_at=now,
                                config=self.config.extra_info, stats=stats)
        pipe = self.r.pipeline(transaction=False)
        pipe.hset(key, mapping=heartbeat.fields())
        pipe.pexpire(key, ttl_ms)
        pipe.sadd(p.WORKERS_SET, self.worker_id)
        if self._block_map is not None:
            pipe.set(p.block_map_key(self.worker_id), p.encode(self._block_map), px=ttl_ms)
        pipe.execute()

    _last_tokens: tuple[float, int] | None = None

    def _tokens_per_s(self, stats: dict) -> float:
        total = int(stats.get("generation_tokens_total", 0) or 0)
        now = time.monotonic()
        previous, self._last_tokens = self._last_tokens, (now, total)
        if previous is None or now <= previous[0]:
            return 0.0
        return round((total - previous[1]) / (now - previous[0]), 2)


def _text(raw) -> str:
    return raw.decode() if isinstance(raw, bytes) else raw


def _request_id(fields: dict, entry_id: str) -> str:
    """The request id of a stream entry, even a malformed one (its errors must reach someone)."""
    try:
        return p.EngineRequest.from_fields(fields).request_id or entry_id
    except (ValueError, TypeError, KeyError):
        return entry_id
