"""Each client in its own virtualenv under var/compat/ (never .venv), as ../shared/peers/*.sh build peers."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

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
