import uuid

import pytest
import redis
from chat_live_engine import clear_engine_keys, start_worker, wait_for
from django.conf import settings as django_settings
from django.contrib.auth import get_user_model


@pytest.fixture
def make_user(db):
    def make(name=None, **extra):
        name = name or f"user-{uuid.uuid4().hex[:6]}"
        return get_user_model().objects.create_user(name, password="a-Long-pass-123", **extra)

    return make


@pytest.fixture
def user(make_user):
    return make_user("alice")


@pytest.fixture
def other_user(make_user):
    return make_user("mallory")


@pytest.fixture
def chat_settings(settings, tiny_model_dir):
    """The playground tokenizes with the served model's tokenizer; quotas get a fresh key prefix."""
    settings.MODEL = tiny_model_dir
    settings.SERVED_MODEL_NAME = "tiny"
    settings.QUOTA_REDIS_PREFIX = f"qchat-{uuid.uuid4().hex[:8]}"
    settings.QUOTA_DEFAULT_PLAN = {
        "name": "default",
        "tokens_per_day": 100_000,
        "requests_per_minute": 100,
        "concurrent_requests": 10,
        "max_tokens_per_request": 512,
    }
    return settings


@pytest.fixture
def worker(llm, chat_settings):
    """A worker thread serving the module's own `llm` fixture over the test Redis."""
    from engine_client import client as engine_client

    client = redis.Redis.from_url(django_settings.REDIS_URL)
    clear_engine_keys(client)
    running = start_worker(llm, django_settings.REDIS_URL)
    wait_for(lambda: engine_client.client().health()["ok"])
    yield running
    running.stop()
    clear_engine_keys(client)
