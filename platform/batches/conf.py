"""Batch limits and tuning, each overridable in settings (names below) or the environment."""

import json
import os

from django.conf import settings

DEFAULTS = {
    "BATCH_FILE_MAX_BYTES": 50 * 1024 * 1024,
    "BATCH_MAX_LINES": 50_000,
    "BATCH_MAX_IN_FLIGHT": 16,  # lines submitted to the engine at once, per batch
    "BATCH_LEASE_SECONDS": 20,  # a runner that stops renewing for this long is presumed dead
    "BATCH_PROGRESS_INTERVAL": 0.5,  # seconds between coarse progress events per batch
    "BATCH_QUOTA_RETRY_SECONDS": 30,  # how often a paused batch retries its quota
    "BATCH_LINE_TIMEOUT": 600,  # seconds one line may run in the engine
    "BATCH_POLL_INTERVAL": 0.25,  # seconds between polls of the in-flight lines' output streams
    "BATCH_FILE_RETENTION_DAYS": 30,  # uploaded and generated files expire after this
    "BATCH_COMPLETION_WINDOWS": {"24h": 24 * 3600},
}


def get(name: str):
    """settings.NAME, else the environment variable NAME (JSON or a number), else the default."""
    if hasattr(settings, name):
        return getattr(settings, name)
    raw = os.environ.get(name)
    if raw is None:
        return DEFAULTS[name]
    return json.loads(raw)
