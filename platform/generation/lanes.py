"""One worker thread that serves jobs in lanes, one lane per user, taking the lanes in turn.

The web process's bookkeeping (admissions, quota renewals, settlements) runs on one thread. Served
first come first served, one user's flood of requests queues hundreds of jobs that every other
user's next admission waits behind; in lanes, that admission waits for at most one job of each
other busy lane. Within a lane jobs keep their order.
"""

from __future__ import annotations

import threading
from collections import OrderedDict, deque
from collections.abc import Callable, Hashable
from concurrent.futures import Future
from typing import Any


class FairLanes:
    def __init__(self, thread_name: str):
        self.thread_name = thread_name
        self.lanes: OrderedDict[Hashable, deque[tuple[Callable[[], Any], Future]]] = OrderedDict()
        self.ready = threading.Condition()
        self.thread: threading.Thread | None = None

    def submit(self, lane: Hashable, job: Callable[[], Any]) -> Future:
        """job() in its turn on the thread; its Future (cancelled before it starts, it never runs)."""
        future: Future = Future()
        with self.ready:
            self.lanes.setdefault(lane, deque()).append((job, future))
            if self.thread is None:
                self.thread = threading.Thread(target=self._serve, name=self.thread_name, daemon=True)
                self.thread.start()
            self.ready.notify()
        return future

    def _next(self) -> tuple[Callable[[], Any], Future]:
        """The first lane's oldest job; a lane with more goes to the back of the line."""
        with self.ready:
            while not self.lanes:
                self.ready.wait()
            lane, jobs = self.lanes.popitem(last=False)
            item = jobs.popleft()
            if jobs:
                self.lanes[lane] = jobs
            return item

    def _serve(self) -> None:
        while True:
            job, future = self._next()
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(job())
            except BaseException as exc:  # the caller's await raises it
                future.set_exception(exc)
