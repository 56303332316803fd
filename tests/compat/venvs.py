"""Each client in its own virtualenv under var/compat/ (never .venv), as ../shared/peers/*.sh build peers."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

VENVS = Path(__file__).resolve().parents[2] / "var" / "compat"


def client_venv(name: str, requirements: list[str]) -> Path:
    """A virtualenv var/compat/<name> with requirements installed (again only when they change); its bin/."""
    venv = VENVS / name
    stamp = venv / "compat-requirements.json"
    if not (stamp.is_file() and json.loads(stamp.read_text()) == requirements):
        subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True)
        subprocess.run([str(venv / "bin" / "pip"), "install", "-q", *requirements], check=True)
        stamp.write_text(json.dumps(requirements))
    return venv / "bin"


def installed_version(bin_dir: Path, distribution: str) -> str:
    code = f"import importlib.metadata as m; print(m.version({distribution!r}))"
    return subprocess.run(
        [str(bin_dir / "python"), "-c", code], check=True, capture_output=True, text=True
    ).stdout.strip()


def wait_until_serving(url: str, process: subprocess.Popen, log: Path, what: str, timeout: float = 300.0) -> None:
    """Until url answers 200; fails with the log's tail if the process exits or the time runs out."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert process.poll() is None, log.read_text(errors="replace")[-4000:]
        try:
            with urllib.request.urlopen(url, timeout=5) as reply:
                if reply.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError):
            pass
        time.sleep(0.5)
    pytest.fail(f"{what} did not come up:\n{log.read_text(errors='replace')[-4000:]}")
