"""A tiny process supervisor for `make run`: start children, prefix their output, stop them all.

Each child runs in its own session (process group), so a terminal's Ctrl-C reaches only the
supervisor, which then stops the children tier by tier (services before the Redis they talk
to): SIGTERM to each whole group (that reaches Celery's pool processes too), then SIGKILL after
a grace period. A child that
exits on its own is reported by name and exit code; the caller decides what to do about it.
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
class Child:
    name: str
    argv: list[str]
    process: subprocess.Popen
    tier: int = 1  # stop order: higher tiers first (all of one tier at once), e.g. Redis is tier 0
    pump: threading.Thread | None = None

    @property
    def pid(self) -> int:
        return self.process.pid

    def running(self) -> bool:
        return self.process.poll() is None


@dataclass
class Exited:
    """A child that stopped without being asked to."""

    name: str
    returncode: int

    def describe(self) -> str:
        code = self.returncode
        how = f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
        return f"{self.name} {how}"


@dataclass
class Supervisor:
    out: TextIO = field(default_factory=lambda: sys.stdout)
    grace_seconds: float = 15.0
    children: list[Child] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _stopping: bool = False
    _hurry: bool = False

    def start(self, name: str, argv: list[str], env: dict | None = None, cwd: str | None = None,
              tier: int = 1) -> Child:
        """Start argv as a child whose output lines are printed as 'name | line'."""
        process = subprocess.Popen(
            argv, env=env, cwd=cwd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, start_new_session=True, bufsize=1, text=True, errors="replace",
        )
        child = Child(name, argv, process, tier)
        child.pump = threading.Thread(target=self._pump, args=(child,), name=f"pump-{name}", daemon=True)
        child.pump.start()
        self.children.append(child)
        return child

    def say(self, line: str) -> None:
        with self._lock:
            self.out.write(line + "\n")
            self.out.flush()

    def _pump(self, child: Child) -> None:
        width = max(8, len(child.name))
        for line in child.process.stdout:
            self.say(f"{child.name:<{width}} | {line.rstrip()}")

    def first_exited(self) -> Exited | None:
        """The first child (in start order) that is no longer running, if any."""
        for child in self.children:
            if not child.running():
                return Exited(child.name, child.process.returncode)
        return None

    def watch(self, poll_seconds: float = 0.5, until: Callable[[], bool] | None = None) -> Exited | None:
        """Block until a child exits (returned) or until() becomes true / stop() is called (None)."""
        while not self._stopping:
            exited = self.first_exited()
            if exited:
                return exited
            if until is not None and until():
                return None
            time.sleep(poll_seconds)
        return None

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
                self.say(f"{child.name} did not stop {'in time' if self._hurry else f'within {self.grace_seconds:g}s'}; killing it")
            # The leader may be gone while its group lives on (e.g. orphaned pool processes).
            _signal_group(child, signal.SIGKILL)
            child.process.wait()


def _signal_group(child: Child, sig: int) -> None:
    try:
        os.killpg(child.pid, sig)  # the child leads its own session, so its pgid is its pid
    except (ProcessLookupError, PermissionError):
        pass
