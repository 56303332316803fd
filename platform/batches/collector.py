"""Coarse, single-threaded collection of many batch lines' results from the engine's output streams.

Interactive callers follow a request token by token (engine_client.stream). A batch needs only
each line's final result, and following dozens of lines token by token would wake the runner on
every engine step and take CPU from the engine and from interactive users. So the runner polls:
every BATCH_POLL_INTERVAL seconds one pipelined round trip reads the last entry of every in-flight
output stream; only streams that ended are read in full and folded with the engine client's own
fold/finalize. Liveness follows the client's rules (docs/protocol.md): a request whose worker lost
its heartbeat ends with "worker_lost", one no worker picked up while none is alive with "no_worker",
and one over its time limit with "timeout" (the last two are aborted, so they never run later).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from engine_client import client as engine
from engine_client import protocol

LIVENESS_EVERY_S = 1.0


@dataclass
class Watched:
    request_id: str
    n: int
    started: float = field(default_factory=time.monotonic)
    worker_id: str | None = None
    no_worker_since: float | None = None


def _events(entries) -> list[dict]:
    events = []
    for _entry_id, fields in entries or []:
        events.extend(protocol.decode(fields[b"events"]))
    return events


def _error_result(code: str, message: str) -> dict:
    result = engine.new_result()
    result["error"] = {"code": code, "message": message}
    result["choices"] = []
    return result


class Collector:
    def __init__(self, timeout: float, no_worker_grace: float = 5.0):
        self.timeout = timeout
        self.no_worker_grace = no_worker_grace
        self.watched: dict[str, Watched] = {}
        self.last_liveness = 0.0

    def add(self, request_id: str, n: int = 1) -> None:
        self.watched[request_id] = Watched(request_id, n)

    def __len__(self) -> int:
        return len(self.watched)

    def poll(self) -> list[tuple[str, dict, float]]:
        """(request_id, result like engine_client.collect's, latency ms) for every request that ended."""
        if not self.watched:
            return []
        r = engine.redis_client()
        ids = list(self.watched)
        pipe = r.pipeline(transaction=False)
        for request_id in ids:
            pipe.xrevrange(protocol.output_stream(request_id), count=1)
        ended = [rid for rid, last in zip(ids, pipe.execute())
                 if any(e.get("type") in protocol.TERMINAL_EVENTS for e in _events(last))]
        done = self._read_results(r, ended)
        if time.monotonic() - self.last_liveness >= LIVENESS_EVERY_S:
            self.last_liveness = time.monotonic()
            done += self._liveness(r, [rid for rid in ids if rid not in ended])
        return done

    def _read_results(self, r, request_ids: list[str]) -> list[tuple[str, dict, float]]:
        if not request_ids:
            return []
        pipe = r.pipeline(transaction=False)
        for request_id in request_ids:
            pipe.xrange(protocol.output_stream(request_id))
        done = []
        for request_id, entries in zip(request_ids, pipe.execute()):
            watched = self.watched.pop(request_id)
            result = engine.new_result()
            for event in _events(entries):
                engine.fold(result, event)
            done.append((request_id, engine.finalize(result, watched.n), self._latency(watched)))
        return done

    def _liveness(self, r, request_ids: list[str]) -> list[tuple[str, dict, float]]:
        """Fail requests that can no longer finish (same verdicts as engine_client.stream)."""
        self._learn_workers(r, request_ids)
        alive_any = bool(engine.live_worker_ids(r))
        done = []
        now = time.monotonic()
        for request_id in request_ids:
            watched = self.watched[request_id]
            verdict = self._verdict(r, watched, now, alive_any)
            if verdict:
                engine.abort(request_id)  # a worker that shows up later must not run it
                del self.watched[request_id]
                done.append((request_id, _error_result(*verdict), self._latency(watched)))
        return done

    def _learn_workers(self, r, request_ids: list[str]) -> None:
        unknown = [rid for rid in request_ids if self.watched[rid].worker_id is None]
        pipe = r.pipeline(transaction=False)
        for request_id in unknown:
            pipe.xrange(protocol.output_stream(request_id), count=1)
        for request_id, first in zip(unknown, pipe.execute() if unknown else []):
            for event in _events(first):
                if event.get("type") == "accepted":
                    self.watched[request_id].worker_id = event.get("worker_id")

    def _verdict(self, r, watched: Watched, now: float, alive_any: bool) -> tuple[str, str] | None:
        if now - watched.started > self.timeout:
            return "timeout", f"no result within {self.timeout:g}s"
        if watched.worker_id:
            if not r.exists(protocol.heartbeat_key(watched.worker_id)):
                return "worker_lost", f"engine worker {watched.worker_id} stopped responding mid-request"
            return None
        if alive_any:
            watched.no_worker_since = None
            return None
        watched.no_worker_since = watched.no_worker_since or now
        if now - watched.no_worker_since >= self.no_worker_grace:
            return "no_worker", "no engine worker is running"
        return None

    @staticmethod
    def _latency(watched: Watched) -> float:
        return (time.monotonic() - watched.started) * 1000
