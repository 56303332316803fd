"""Coarse, single-threaded collection of many batch lines' results from the engine's output streams.

Interactive callers follow a request token by token (engine_client's stream()). A batch needs only
each line's final result, and following dozens of lines token by token would wake the runner on
every engine step and take CPU from the engine and from interactive users. So the runner polls:
every BATCH_POLL_INTERVAL seconds one pipelined round trip reads the last entry of every in-flight
output stream; only streams that ended are read in full (the runner folds them into the line's
generation result). Liveness is the engine client's own verdict (engine_client.client.Liveness), read
once a second for all lines: "worker_lost", "no_worker" (no live worker serves the line's model)
and "timeout"; the last two are aborted, so they never run later.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from engine_client import client as engine
from inference import protocol

LIVENESS_EVERY_S = 1.0


@dataclass
class Watched:
    request_id: str
    liveness: engine.Liveness


class Collector:
    def __init__(self, timeout: float, no_worker_grace: float = engine.NO_WORKER_GRACE_S):
        self.timeout = timeout
        self.no_worker_grace = no_worker_grace
        self.watched: dict[str, Watched] = {}
        self.last_liveness = 0.0

    def add(self, request_id: str, model: str | None = None) -> None:
        liveness = engine.Liveness(model, no_worker_grace=self.no_worker_grace, timeout=self.timeout)
        self.watched[request_id] = Watched(request_id, liveness)

    def __len__(self) -> int:
        return len(self.watched)

    def poll(self) -> list[tuple[str, list[dict]]]:
        """(request_id, its events, ending with the terminal one) for every request that ended."""
        if not self.watched:
            return []
        client = engine.client()
        ids = list(self.watched)
        pipe = client.r.pipeline(transaction=False)
        for request_id in ids:
            pipe.xrevrange(protocol.output_stream(request_id), count=1)
        ended = [
            rid
            for rid, last in zip(ids, pipe.execute())
            if any(e.get("type") in protocol.TERMINAL_EVENTS for _id, f in last for e in protocol.events_of(f))
        ]
        done = [self._result(client, rid) for rid in ended]
        if time.monotonic() - self.last_liveness >= LIVENESS_EVERY_S:
            self.last_liveness = time.monotonic()
            done += self._liveness(client, [rid for rid in ids if rid not in ended])
        return done

    def _result(self, client: engine.EngineClient, request_id: str) -> tuple[str, list[dict]]:
        del self.watched[request_id]
        return request_id, client.read_output(request_id)

    def _liveness(self, client: engine.EngineClient, request_ids: list[str]) -> list[tuple[str, list[dict]]]:
        """Fail requests that can no longer finish (the same verdict as the client's streams)."""
        for request_id in request_ids:
            if self.watched[request_id].liveness.worker_id is None:  # learn who claimed it: the first event
                for event in client.read_output(request_id, count=1):
                    self.watched[request_id].liveness.see(event)
        live = client.live_workers() if request_ids else {}
        done = []
        for request_id in request_ids:
            watched = self.watched[request_id]
            if error := watched.liveness.verdict(live):
                client.abort(request_id)  # a worker that shows up later must not run it
                del self.watched[request_id]
                done.append((request_id, [error]))
        return done
