"""Secrets kept in files only their owner can read (the embedded Redis password, a SECRET_KEY)."""

from __future__ import annotations

import os
import secrets
from pathlib import Path


def read_or_create_secret(path: Path, nbytes: int) -> str:
    """The secret in `path`, made on first use (O_EXCL: two processes starting at once agree on one)."""
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            return path.read_text().strip()
        with os.fdopen(fd, "w") as out:
            out.write(secrets.token_urlsafe(nbytes))
    return path.read_text().strip()
