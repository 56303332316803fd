"""Fixtures for the batch tests: users with API keys, the tiny model's tokenizer, JSONL builders."""

from __future__ import annotations

import pytest
from batch_testing import MODEL_NAME  # noqa: E402


@pytest.fixture(autouse=True)
def batch_settings(settings, tiny_model_dir):
    """The web tier tokenizes with the served model's tokenizer; quotas unlimited unless a test says so."""
    settings.MODEL = tiny_model_dir
    settings.SERVED_MODEL_NAME = MODEL_NAME
    settings.QUOTA_DEFAULT_PLAN = {
        "name": "test",
        "tokens_per_day": None,
        "tokens_per_month": None,
        "requests_per_minute": None,
        "concurrent_requests": None,
        "max_tokens_per_request": 512,
        "allowed_models": [],
    }
    return settings


@pytest.fixture
def user(django_user_model):
    return django_user_model.objects.create_user("alice", password="pw-alice-123")


@pytest.fixture
def other_user(django_user_model):
    return django_user_model.objects.create_user("bob", password="pw-bob-123")


@pytest.fixture
def api_key(user):
    from accounts.services import create_api_key

    return create_api_key(user, name="test")[1]


@pytest.fixture
def other_api_key(other_user):
    from accounts.services import create_api_key

    return create_api_key(other_user, name="test")[1]
