"""Redis going away under a live web server (dev settings, DEBUG on, as `make run` serves): the machine paths
answer 503 in the envelope, never a 500 or a DEBUG page, and recover once Redis is back, without a restart.
"""

from __future__ import annotations

import httpx
import pytest

from tests.platform.security.live_web import Server

pytestmark = pytest.mark.slow


@pytest.fixture
def server(tmp_path):
    running = Server(tmp_path)
    yield running
    running.stop()


def _requests(api_key: str) -> list[tuple[str, str, dict]]:
    auth = {"Authorization": f"Bearer {api_key}"}
    chat = {"model": "tessera-demo", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    return [
        ("GET", "/v1/models", {"headers": auth}),
        ("POST", "/v1/chat/completions", {"headers": auth, "json": chat}),
        ("POST", "/v1/chat/completions", {"headers": auth, "json": {**chat, "stream": True}}),
        ("POST", "/v1/completions", {"headers": auth, "json": {"model": "tessera-demo", "prompt": "hi"}}),
        ("GET", "/metrics", {}),
    ]


def test_redis_down_is_a_503_envelope_and_the_web_tier_recovers(server):
    api_key = server.start()
    assert httpx.get(server.url("/v1/models"), headers={"Authorization": f"Bearer {api_key}"}).status_code == 200

    server.stop_redis()
    for method, path, kwargs in _requests(api_key):
        response = httpx.request(method, server.url(path), timeout=30, **kwargs)
        assert response.status_code == 503, (path, response.status_code, response.text[:500])
        assert response.headers["content-type"].startswith("application/json"), (path, response.text[:500])
        error = response.json()["error"]
        assert error["type"] == "service_unavailable" and error["code"] == "redis_unavailable", (path, error)
        assert "DATABASES" not in response.text and "REDIS_URL" not in response.text
    health = httpx.get(server.url("/health"), timeout=30)
    assert health.status_code == 503 and health.json()["redis"] is False
    assert "could not count a /v1 request" in server.log_path.read_text()  # logged, not raised

    server.restart_redis()
    models = httpx.get(server.url("/v1/models"), headers={"Authorization": f"Bearer {api_key}"}, timeout=30)
    assert models.status_code == 200 and models.json()["object"] == "list"
    assert "tessera_http_requests_total" in httpx.get(server.url("/metrics"), timeout=30).text


def test_redis_down_creating_a_batch_is_a_503(server):
    import json

    api_key = server.start()
    auth = {"Authorization": f"Bearer {api_key}"}
    line = {
        "custom_id": "a",
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {"model": "m", "messages": [{"role": "user", "content": "hi"}]},
    }
    uploaded = httpx.post(
        server.url("/v1/files"),
        headers=auth,
        data={"purpose": "batch"},
        files={"file": ("in.jsonl", json.dumps(line).encode())},
    ).json()
    server.stop_redis()
    response = httpx.post(
        server.url("/v1/batches"),
        headers=auth,
        timeout=30,
        json={"input_file_id": uploaded["id"], "endpoint": "/v1/chat/completions", "completion_window": "24h"},
    )
    assert response.status_code == 503 and response.json()["error"]["code"] == "redis_unavailable", response.text
    server.restart_redis()  # no batch row was left behind: a retry cannot make a second batch
    listed = httpx.get(server.url("/v1/batches"), headers=auth, timeout=30)
    assert listed.status_code == 200 and listed.json()["data"] == [], listed.text
