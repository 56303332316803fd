"""The Celery app: `celery -A tessera worker` with platform/ on sys.path (the Makefile sets it)."""

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tessera.settings.dev")

from celery import Celery  # noqa: E402

app = Celery("tessera")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()
