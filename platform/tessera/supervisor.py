"""A tiny process supervisor for `make run`: start children, prefix their output, restart the ones
that die, stop them all.

Each child runs in its own session (process group), so a terminal's Ctrl-C reaches only the
supervisor, which then stops the children tier by tier (services before the Redis they talk
to): SIGTERM to each whole group (that reaches Celery's pool processes too), then SIGKILL after
a grace period. A child that exits on its own is reported by name and exit code; one started
with a RestartPolicy is started again after a backoff (as compose's `restart:` policies do),
until it fails fast too many times in a row; then (or at once, without a policy) watch()
returns it and the caller decides what to do.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, TextIO


@dataclass
class RestartPolicy:
    """Start a child again when it dies: after backoff_s, doubled for each fast failure in a row (one
    within min_uptime_s of its start) up to max_backoff_s; give up after max_fast_failures of them."""

    backoff_s: float = 1.0
    max_backoff_s: float = 30.0
    min_uptime_s: float = 10.0
    max_fast_failures: int = 5

    def delay(self, fast_failures: int) -> float:
        return min(self.max_backoff_s, self.backoff_s * 2 ** max(fast_failures - 1, 0))


@dataclass
class Child:
    name: str
    argv: list[str]
    process: subprocess.Popen
    tier: int = 1  # stop order: higher tiers first (all of one tier at once), e.g. Redis is tier 0
    pump: threading.Thread | None = None
    env: dict | None = None
    cwd: str | None = None
    restart: RestartPolicy | None = None
    on_exit: Callable[["Child"], None] | None = None  # called once per death, before any restart
    pass_fds: tuple[int, ...] = ()  # descriptors the child inherits (e.g. a shared listening socket), each start
    started_at: float = field(default_factory=time.monotonic)
    fast_failures: int = 0  # deaths in a row, each soon after its start
    restarts: int = 0
    restart_at: float | None = None  # set while the child waits out its backoff
    down: "Exited | None" = None  # set once it is down for good (no policy, or given up)

    @property
    def pid(self) -> int:
        return self.process.pid

    def running(self) -> bool:
        return self.process.poll() is None


@dataclass
class Exited:
    """A child that stopped without being asked to (fast_failures > 0: its restarts were given up)."""

    name: str
    returncode: int
    fast_failures: int = 0

    def describe(self) -> str:
        code = self.returncode
        how = f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
        if self.fast_failures:
            how += f" ({self.fast_failures} times in a row, each soon after starting; not restarting it again)"
        return f"{self.name} {how}"


@dataclass
class Supervisor:
    out: TextIO = field(default_factory=lambda: sys.stdout)
    grace_seconds: float = 15.0
    children: list[Child] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _stopping: bool = False
    _hurry: bool = False

    def start(
        self,
        name: str,
        argv: list[str],
        env: dict | None = None,
        cwd: str | None = None,
        tier: int = 1,
        restart: RestartPolicy | None = None,
        on_exit: Callable[[Child], None] | None = None,
        pass_fds: tuple[int, ...] = (),
    ) -> Child:
        """Start argv as a child whose output lines are printed as 'name | line'; pass_fds stay open in it
        (the caller keeps them open too, so a restart gets the same ones)."""
        pass_fds = tuple(pass_fds)
        child = Child(
            name,
            argv,
            _spawn(argv, env, cwd, pass_fds),
            tier,
            env=env,
            cwd=cwd,
            restart=restart,
            on_exit=on_exit,
            pass_fds=pass_fds,
        )
        self._pump_output(child)
        self.children.append(child)
        return child

    def _pump_output(self, child: Child) -> None:
        child.pump = threading.Thread(
            target=self._pump, args=(child, child.process), name=f"pump-{child.name}", daemon=True
        )
        child.pump.start()

    def say(self, line: str) -> None:
        with self._lock:
            self.out.write(line + "\n")
            self.out.flush()

    def _pump(self, child: Child, process: subprocess.Popen) -> None:
        width = max(8, len(child.name))
        for line in process.stdout:
            self.say(f"{child.name:<{width}} | {line.rstrip()}")

    def watch(self, poll_seconds: float = 0.5, until: Callable[[], bool] | None = None) -> Exited | None:
        """Block until until() becomes true or stop() is called (None), restarting children that die
        under a restart policy; a child that dies without one (or gives up) is returned."""
        while not self._stopping:
            exited = self.tend()
            if exited:
                return exited
            if until is not None and until():
                return None
            time.sleep(poll_seconds)
        return None

    def tend(self) -> Exited | None:
        """One look at every child: schedule or do due restarts; the first child that is down for good."""
        now = time.monotonic()
        for child in self.children:
            if child.restart_at is not None:
                if now >= child.restart_at:
                    self._respawn(child)
            elif child.down is not None:
                return child.down
            elif not child.running():
                child.down = self._died(child, now)
                if child.down:
                    return child.down
        return None

    def _died(self, child: Child, now: float) -> Exited | None:
        exited = Exited(child.name, child.process.returncode)
        _signal_group(child, signal.SIGKILL)  # what is left of its group (e.g. Celery's pool processes)
        if child.on_exit is not None:
            child.on_exit(child)
        policy = child.restart
        if policy is None:
            return exited
        fast = now - child.started_at < policy.min_uptime_s
        child.fast_failures = child.fast_failures + 1 if fast else 0
        if child.fast_failures >= policy.max_fast_failures:
            exited.fast_failures = child.fast_failures
            return exited
        delay = policy.delay(child.fast_failures)
        child.restart_at = now + delay
        self.say(f"{exited.describe()}; restarting it in {delay:g}s")
        return None

    def _respawn(self, child: Child) -> None:
        child.restart_at = None
        child.restarts += 1
        child.started_at = time.monotonic()
        child.process = _spawn(child.argv, child.env, child.cwd, child.pass_fds)
        self._pump_output(child)
        self.say(f"{child.name} restarted (restart {child.restarts})")

    def stop(self) -> None:
        """Stop the children tier by tier (highest first): SIGTERM to each process group of the
        tier at once, wait up to grace_seconds, then SIGKILL whatever is left of those groups."""
        self._stopping = True
        for tier in sorted({c.tier for c in self.children}, reverse=True):
            self._stop_all([c for c in self.children if c.tier == tier])
        for child in self.children:
            if child.pump is not None:
                child.pump.join(timeout=2)

    def hurry(self) -> None:
        """Cut the grace period short (a second Ctrl-C): what is still running gets SIGKILL now."""
        self._hurry = True

    def _stop_all(self, children: list[Child]) -> None:
        for child in children:
            _signal_group(child, signal.SIGTERM)
        deadline = time.monotonic() + self.grace_seconds
        while any(c.running() for c in children) and time.monotonic() < deadline and not self._hurry:
            time.sleep(0.05)
        for child in children:
            if child.running():
                deadline = "in time" if self._hurry else f"within {self.grace_seconds:g}s"
                self.say(f"{child.name} did not stop {deadline}; killing it")
            # The leader may be gone while its group lives on (e.g. orphaned pool processes).
            _signal_group(child, signal.SIGKILL)
            child.process.wait()


def _spawn(argv: list[str], env: dict | None, cwd: str | None, pass_fds: tuple[int, ...] = ()) -> subprocess.Popen:
    return subprocess.Popen(
        argv,
        env=env,
        cwd=cwd,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        bufsize=1,
        text=True,
        errors="replace",
        pass_fds=pass_fds,
    )


def _signal_group(child: Child, sig: int) -> None:
    try:
        os.killpg(child.pid, sig)  # the child leads its own session, so its pgid is its pid
    except (ProcessLookupError, PermissionError):
        pass
