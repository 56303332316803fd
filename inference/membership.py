"""One worker's place in the cluster (docs/protocol.md, Heartbeat and Worker death): its heartbeat
with a snapshot of engine stats, the reaping of workers whose heartbeat is gone, and leaving.

A worker counts as alive exactly while its heartbeat key exists. The heartbeat runs on a thread of
its own, so a long engine step never makes a live worker look dead; that thread only reads the
snapshot the loop's thread copies (only the loop's thread touches the engine).
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import redis

from inference import protocol

log = logging.getLogger("tessera.worker")

# (pipe, stream, entry_id, request_id, event): answer a request with its one terminal event and XACK it
EndEarly = Callable[[redis.client.Pipeline, str, str, str, protocol.Event], None]


class Membership:
    def __init__(
        self,
        r: redis.Redis,
        engine,
        *,
        worker_id: str,
        model_name: str,
        served_model_names: list[str],
        request_streams: list[str],
        extra_info: dict,
        heartbeat_interval: float,
        heartbeat_ttl: float,
        reap_interval: float,
        stopping: threading.Event,
        loop_stats: Callable[[], dict],
        end_early: EndEarly,
    ):
        self.r = r
        self.engine = engine
        self.worker_id = worker_id
        self.model_name = model_name
        self.served_model_names = served_model_names
        self.request_streams = request_streams
        self.extra_info = extra_info
        self.heartbeat_interval = heartbeat_interval
        self.heartbeat_ttl = heartbeat_ttl
        self.reap_interval = reap_interval
        self.started_at = time.time()
        self._stopping = stopping  # the worker's: set, the heartbeat thread ends
        self._loop_stats = loop_stats
        self._end_early = end_early
        self._snapshot: dict = {}
        self._snapshot_at = 0.0
        self._block_map = None
        self._last_reap = 0.0
        self._last_tokens: tuple[float, int] | None = None
        self._heartbeat_thread: threading.Thread | None = None

    # ------------------------------------------------------------ joining and leaving

    def join(self) -> None:
        """Publish the first heartbeat now and keep it fresh from a thread."""
        self.take_snapshot(force=True)
        self.publish_heartbeat()
        self._heartbeat_thread = threading.Thread(target=self._heartbeat_loop, name="heartbeat", daemon=True)
        self._heartbeat_thread.start()

    def leave(self) -> None:
        """After the worker's stopping event is set: delete the heartbeat, the block map and the consumer."""
        if self._heartbeat_thread:
            self._heartbeat_thread.join(timeout=2)
        pipe = self.r.pipeline(transaction=False)
        pipe.delete(protocol.heartbeat_key(self.worker_id), protocol.block_map_key(self.worker_id))
        pipe.srem(protocol.WORKERS_SET, self.worker_id)
        for stream in self.request_streams:
            pipe.xgroup_delconsumer(stream, protocol.CONSUMER_GROUP, self.worker_id)
        try:
            pipe.execute()
        except redis.RedisError as exc:
            log.warning("clean-up on shutdown failed: %s", exc)

    # ------------------------------------------------------------ heartbeat

    def take_snapshot(self, force: bool = False) -> None:
        """Copy engine stats and the block map for the heartbeat thread, at most twice an interval."""
        now = time.monotonic()
        if not force and now - self._snapshot_at < self.heartbeat_interval / 2:
            return
        self._snapshot_at = now
        stats = dict(self.engine.get_stats())
        stats.update(self._loop_stats())
        metrics = getattr(self.engine, "metrics", None)
        if metrics is not None:  # histograms for /metrics, copied here: the engine's thread updates them
            stats["engine_metrics"] = metrics.snapshot()
        self._snapshot = stats
        block_map = getattr(self.engine, "block_map", None)
        if block_map is not None:
            self._block_map = block_map()

    def _heartbeat_loop(self) -> None:
        while not self._stopping.wait(self.heartbeat_interval):
            try:
                self.publish_heartbeat()
            except redis.RedisError as exc:
                log.warning("heartbeat failed: %s", exc)

    def publish_heartbeat(self) -> None:
        stats = dict(self._snapshot)
        stats["tokens_per_s"] = self._tokens_per_s(stats)
        ttl_ms = int(self.heartbeat_ttl * 1000)
        key = protocol.heartbeat_key(self.worker_id)
        heartbeat = protocol.Heartbeat(
            worker_id=self.worker_id,
            model=self.model_name,
            served_model_names=self.served_model_names,
            pid=os.getpid(),
            host=socket.gethostname(),
            started_at=self.started_at,
            updated_at=time.time(),
            config=self.extra_info,
            stats=stats,
        )
        pipe = self.r.pipeline(transaction=False)
        fields: dict[Any, Any] = heartbeat.fields()  # redis-py's stubs want a wider key type than str
        pipe.hset(key, mapping=fields)
        pipe.pexpire(key, ttl_ms)
        pipe.sadd(protocol.WORKERS_SET, self.worker_id)
        if self._block_map is not None:
            pipe.set(protocol.block_map_key(self.worker_id), protocol.encode(self._block_map), px=ttl_ms)
        pipe.execute()

    def _tokens_per_s(self, stats: dict) -> float:
        total = int(stats.get("generation_tokens_total", 0) or 0)
        now = time.monotonic()
        previous, self._last_tokens = self._last_tokens, (now, total)
        if previous is None or now <= previous[0]:
            return 0.0
        return round((total - previous[1]) / (now - previous[0]), 2)

    # ------------------------------------------------------------ dead workers

    def reap_when_due(self) -> None:
        if time.monotonic() - self._last_reap > self.reap_interval:
            self._last_reap = time.monotonic()
            self.reap_dead_workers()

    def reap_dead_workers(self) -> int:
        """Fail the pending requests of consumers without a heartbeat (a worker that died mid-request)."""
        reaped = 0
        for stream in self.request_streams:
            try:
                consumers = self.r.xinfo_consumers(stream, protocol.CONSUMER_GROUP)
            except redis.ResponseError:
                continue
            for consumer in consumers:
                name = text(consumer["name"])
                if name == self.worker_id or self.r.exists(protocol.heartbeat_key(name)):
                    continue
                reaped += self._reap_consumer(stream, name, int(consumer.get("pending", 0)))
        return reaped

    def _reap_consumer(self, stream: str, name: str, pending: int) -> int:
        reaped = 0
        if pending:
            rows = self.r.xpending_range(
                stream, protocol.CONSUMER_GROUP, min="-", max="+", count=pending, consumername=name
            )
            ids: list[Any] = [row["message_id"] for row in rows]
            # XCLAIM with a min idle time: of two surviving workers only one wins each entry.
            claimed: list[Any] = (
                self.r.xclaim(stream, protocol.CONSUMER_GROUP, self.worker_id, min_idle_time=500, message_ids=ids)
                if ids
                else []
            )
            pipe = self.r.pipeline(transaction=False)
            for entry_id, fields in claimed:
                if not fields:
                    continue
                event = protocol.error_event("worker_lost", f"engine worker {name} died while running this request")
                self._end_early(pipe, stream, text(entry_id), request_id_of(fields, text(entry_id)), event)
                reaped += 1
            pipe.execute()
        still = self.r.xpending_range(stream, protocol.CONSUMER_GROUP, min="-", max="+", count=1, consumername=name)
        if not still:
            self.r.xgroup_delconsumer(stream, protocol.CONSUMER_GROUP, name)
            self.r.srem(protocol.WORKERS_SET, name)
        if reaped:
            log.warning("failed %d requests of dead worker %s", reaped, name)
        return reaped


def text(raw) -> str:
    return raw.decode() if isinstance(raw, bytes) else raw


def request_id_of(fields: dict, entry_id: str) -> str:
    """The request id of a stream entry, even a malformed one (its errors must reach someone)."""
    try:
        return protocol.EngineRequest.from_fields(fields).request_id or entry_id
    except (ValueError, TypeError, KeyError):
        return entry_id
