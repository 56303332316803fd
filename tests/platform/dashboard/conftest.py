"""Dashboard fixtures: staff and plain users, synthetic usage, and a fake engine heartbeat in Redis."""

from __future__ import annotations

import time

import pytest
from dashboard_testing import NOW, clear_heartbeat, fake_heartbeat


@pytest.fixture
def staff_user(django_user_model):
    return django_user_model.objects.create_user("ops", password="pw-ops-123", is_staff=True)


@pytest.fixture
def plain_user(django_user_model):
    return django_user_model.objects.create_user("alice", password="pw-alice-123")


@pytest.fixture
def generated_usage(db):
    """Three days of synthetic usage for five users, ending at NOW (about 2,000 rows)."""
    from dashboard import synthetic

    synthetic.generate(days=3, users=5, requests_per_day=700, seed=7, now=NOW)


@pytest.fixture
def recent_usage(db):
    """Two days of synthetic usage ending at the real now (for views, whose windows end now)."""
    from dashboard import synthetic

    synthetic.generate(days=2, users=4, requests_per_day=400, seed=3)


@pytest.fixture
def fake_worker():
    worker_id = f"dash-test-{time.monotonic_ns()}"
    fake_heartbeat(worker_id)
    yield worker_id
    clear_heartbeat(worker_id)
