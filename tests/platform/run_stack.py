"""`python -m tessera.run` started the way `make run` starts it, for end-to-end and chaos tests.

Its output goes to a file; children are found through /proc (their command lines), and the
Redis URL every child got is read from a child's environment, as another process of this user
could. close() kills whatever is left (also when a test failed midway).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tessera.embedded_redis import free_port

REPO = Path(__file__).resolve().parents[2]
WEB_PROCESS = "-m tessera.web"  # what a web process's command line contains (the default WEB_SERVER)


def descendants(pid: int) -> set[int]:
    """Every live process below pid, from /proc (children of children included)."""
    parents = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except (FileNotFoundError, ProcessLookupError):
                continue
            if fields[0] != "Z":
                parents[int(entry.name)] = int(fields[1])
    found, frontier = set(), {pid}
    while frontier:
        frontier = {child for child, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return found


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except (FileNotFoundError, ProcessLookupError):
        return ""


def environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(item.decode().split("=", 1) for item in raw if b"=" in item)


def make_run_env(model_dir: str, var_dir: Path, **extra: str) -> dict[str, str]:
    """The environment of a `make run` on a free port with its own var dir (embedded Redis, SQLite)."""
    # The test session's own database (make test's TESSERA_DB) is not the stack's: make run's default is SQLite.
    inherited = ("REDIS_URL", "DATABASE_URL", "DJANGO_SETTINGS_MODULE", "TESSERA_DB")
    env = {k: v for k, v in os.environ.items() if k not in inherited}
    env.update(
        {
            "PORT": str(free_port()),
            "MODEL": model_dir,
            "TESSERA_VAR_DIR": str(var_dir),
            "DJANGO_SETTINGS_MODULE": "tessera.settings.dev",
            "CELERY_CONCURRENCY": "1",
            "READY_TIMEOUT": "240",
            "ENGINE_ARGS": '{"num_kv_blocks": 128, "max_model_len": 256, "device": "cpu"}',
            "EMBEDDING_MODEL": "off",  # one engine worker unless a test asks for the embedding one too
            "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "platform")]),
            **extra,
        }
    )
    return env


class RunStack:
    """`python -m tessera.run` (or another command that runs it: `tessera serve`) with its output collected
    in a file."""

    def __init__(self, env: dict, log: Path, command: list[str] | None = None):
        self.env = env
        self.log = log
        self.handle = log.open("w")
        self.process = subprocess.Popen(
            command or [sys.executable, "-m", "tessera.run"],
            cwd=REPO,
            env=env,
            stdout=self.handle,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    @classmethod
    def start(cls, env: dict, log: Path, timeout: float = 300, command: list[str] | None = None) -> "RunStack":
        stack = cls(env, log, command)
        try:
            stack.wait_for(r"^ready: http://127\.0\.0\.1:\d+/", timeout=timeout)
        except BaseException:
            stack.close()
            raise
        return stack

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.env['PORT']}"

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def mark(self) -> int:
        """Where the output ends now: wait_for(..., since=mark) looks only at what comes later."""
        return len(self.output())

    def wait_for(self, pattern: str, timeout: float, since: int = 0) -> re.Match:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            match = re.search(pattern, self.output()[since:], re.MULTILINE)
            if match:
                return match
            if self.process.poll() is not None:
                break
            time.sleep(0.2)
        pytest.fail(f"no {pattern!r} in the output (exit code {self.process.poll()}):\n{self.output()[-6000:]}")

    def admin_login(self) -> tuple[str, str]:
        """The admin password and API key printed once by the first run."""
        text = self.output()
        return (
            re.search(r"admin login: admin / (\S+)", text).group(1),
            re.search(r"API key:\s+(tsk-\S+)", text).group(1),
        )

    def pids(self, command_part: str) -> list[int]:
        """The supervisor's own children whose command line contains command_part."""
        direct = {pid for pid in descendants(self.process.pid) if _parent(pid) == self.process.pid}
        return sorted(pid for pid in direct if command_part in cmdline(pid))

    def pid(self, command_part: str) -> int:
        [found] = self.pids(command_part)
        return found

    def redis_url(self) -> str:
        return environ(self.pid(WEB_PROCESS))["REDIS_URL"]

    def close(self) -> None:
        if self.process.poll() is None:  # the test failed midway: take everything down
            left = descendants(self.process.pid)
            os.killpg(self.process.pid, signal.SIGKILL)
            for pid in left:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        self.process.wait()
        self.handle.close()


def _parent(pid: int) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (FileNotFoundError, ProcessLookupError):
        return None
