"""Request handling that needs no engine: auth, JSON errors, 503 without a worker, the DRF error envelope."""

from __future__ import annotations

import asyncio

import pytest
import redis
from django.conf import settings
from django.contrib.auth.models import User
from django.test import AsyncClient, Client
from rest_framework import exceptions

from accounts.services import create_api_key
from openai_api.errors import drf_exception_handler
from tests.inference.worker_helpers import clear_engine_keys

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def raw_key():
    clear_engine_keys(redis.Redis.from_url(settings.REDIS_URL))
    user = User.objects.create_user("ada", password="pw-long-enough")
    return create_api_key(user)[1]


def _envelope_ok(body: dict) -> bool:
    return set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}


def test_without_a_worker_generation_is_503_and_health_is_down(raw_key):
    client = Client()
    response = client.post(
        "/v1/completions",
        {"model": settings.SERVED_MODEL_NAME, "prompt": "hi"},
        content_type="application/json",
        HTTP_AUTHORIZATION=f"Bearer {raw_key}",
    )
    assert response.status_code == 503 and _envelope_ok(response.json())
    assert response.json()["error"]["code"] == "engine_unavailable"
    health = client.get("/health")
    assert health.status_code == 503 and health.json()["engine"] is False


@pytest.mark.parametrize("model, status", [("gpt-4", 404)])
def test_unknown_model_is_404_even_without_workers(raw_key, model, status):
    response = Client().post(
        "/v1/chat/completions",
        {"model": model, "messages": [{"role": "user", "content": "x"}]},
        content_type="application/json",
        HTTP_AUTHORIZATION=f"Bearer {raw_key}",
    )
    assert response.status_code == status and response.json()["error"]["param"] == "model"


def test_async_client_gets_the_same_envelopes(raw_key):
    asyncio.run(_async_envelopes(raw_key))


async def _async_envelopes(raw_key):
    client = AsyncClient()
    bad_json = await client.post(
        "/v1/chat/completions", b"{", content_type="application/json", headers={"Authorization": f"Bearer {raw_key}"}
    )
    assert bad_json.status_code == 400 and bad_json.json()["error"]["code"] == "invalid_json"
    no_key = await client.post("/v1/chat/completions", b"{}", content_type="application/json")
    assert no_key.status_code == 401 and _envelope_ok(no_key.json())
    nested = await client.post(
        "/v1/chat/completions",
        {"model": "m", "messages": [{"role": "robot"}]},
        content_type="application/json",
        headers={"Authorization": f"Bearer {raw_key}"},
    )
    assert nested.status_code == 400 and nested.json()["error"]["param"] == "messages[0].role"


@pytest.mark.parametrize(
    "exc, status, param",
    [
        (exceptions.ValidationError({"purpose": ["must be batch"]}), 400, "purpose"),
        (exceptions.NotAuthenticated(), 401, None),
        (exceptions.NotFound(), 404, None),
        (RuntimeError("boom"), 500, None),
    ],
)
def test_drf_views_answer_in_the_openai_envelope(exc, status, param):
    response = drf_exception_handler(exc, {})
    assert response.status_code == status and _envelope_ok(response.data)
    assert response.data["error"]["param"] == param
