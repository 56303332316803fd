"""DEBUG never on a network-facing bind: what `make run` changes (or refuses) before serving HOST.

On loopback the dev settings stay as they are. On any other address a DEBUG page would show the
settings and environment to the network, and the public dev SECRET_KEY would let anyone forge a
session cookie (an admin's included), so run.py calls network_safe_env() first: DEBUG=1 given
explicitly is refused; otherwise DEBUG goes off and, unless SECRET_KEY is set, a private key is
made once in var/secret_key (mode 0600) and reused, so sessions survive restarts.
"""

from __future__ import annotations

import ipaddress
from pathlib import Path

from tessera.private_files import read_or_create_secret

DEV_SECRET_KEY = "dev-insecure-change-me"  # known to everyone: loopback development only
SECRET_KEY_FILE = "secret_key"


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a host name that may resolve anywhere: treat it as network-facing


def network_safe_env(host: str, env, var_dir: Path) -> dict[str, str]:
    """The environment changes that make serving on `host` safe ({} on loopback); SystemExit for DEBUG=1."""
    if is_loopback(host):
        return {}
    if env.get("DEBUG") == "1":
        raise SystemExit(
            f"refusing to serve HOST={host} with DEBUG=1: a debug page shows settings and "
            "secrets to the network. Unset DEBUG, or bind to 127.0.0.1."
        )
    changes = {"DEBUG": "0"}
    if env.get("SECRET_KEY", DEV_SECRET_KEY) == DEV_SECRET_KEY:
        changes["SECRET_KEY"] = private_secret_key(Path(var_dir))
    print(
        f"HOST={host} is network-facing: DEBUG off"
        + (f", SECRET_KEY from {Path(var_dir) / SECRET_KEY_FILE}" if "SECRET_KEY" in changes else ""),
        flush=True,
    )
    return changes


def private_secret_key(var_dir: Path) -> str:
    """This installation's own key: made on first use, readable by its owner only."""
    return read_or_create_secret(var_dir / SECRET_KEY_FILE, 50)
