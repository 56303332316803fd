"""Redis going away under a live daphne (dev settings, DEBUG on, as `make run` serves): the machine paths
answer 503 in the envelope, never a 500 or a DEBUG page, and recover once Redis is back, without a restart.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tessera import embedded_redis

pytestmark = pytest.mark.slow
REPO_DIR = Path(__file__).resolve().parents[3]


class Server:
    """daphne on the real ASGI app with its own SQLite file and a redis-server this test stops and starts."""

    def __init__(self, work_dir: Path):
        self.work_dir = work_dir
        self.redis_url, self.redis = embedded_redis.start(data_dir=str(work_dir))
        self.redis_port = int(self.redis_url.rsplit(":", 1)[1].split("/")[0])
        self.port = embedded_redis.free_port()
        self.env = {**os.environ, "DJANGO_SETTINGS_MODULE": "tessera.settings.dev", "DEBUG": "1",
                    "REDIS_URL": self.redis_url, "DATABASE_URL": f"sqlite:///{work_dir / 'db.sqlite3'}",
                    "TESSERA_VAR_DIR": str(work_dir), "PYTHONPATH": f"{REPO_DIR}{os.pathsep}{REPO_DIR / 'platform'}"}
        self.log_path = work_dir / "daphne.log"
        self.daphne = None

    def manage(self, *args: str) -> str:
        done = subprocess.run([sys.executable, "manage.py", *args], cwd=REPO_DIR, env=self.env, capture_output=True,
                              text=True, timeout=300, check=True)
        return done.stdout

    def start(self) -> str:
        self.manage("migrate", "--noinput")
        self.manage("shell", "-c", "from django.contrib.auth.models import User; "
                                   "User.objects.create_user('outage', password='pw-long-enough-1')")
        api_key = self.manage("create_api_key", "outage").strip().splitlines()[-1]
        with open(self.log_path, "wb") as log:
            self.daphne = subprocess.Popen([sys.executable, "-m", "daphne", "-b", "127.0.0.1", "-p", str(self.port),
                                            "tessera.asgi:application"], cwd=REPO_DIR, env=self.env, stdout=log,
                                           stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            assert self.daphne.poll() is None, self.log_path.read_text()
            try:
                httpx.get(self.url("/health"), timeout=2)
                return api_key
            except httpx.TransportError:
                time.sleep(0.2)
        raise AssertionError("daphne did not answer within 120 s:\n" + self.log_path.read_text())

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def stop_redis(self) -> None:
        self.redis.terminate()
        self.redis.wait(10)

    def restart_redis(self) -> None:
        _url, self.redis = embedded_redis.start(port=self.redis_port, data_dir=str(self.work_dir))

    def stop(self) -> None:
        if self.daphne is not None and self.daphne.poll() is None:
            self.daphne.terminate()
            self.daphne.wait(10)
        if self.redis.poll() is None:
            self.stop_redis()


@pytest.fixture
def server(tmp_path):
    running = Server(tmp_path)
    yield running
    running.stop()


def _requests(api_key: str) -> list[tuple[str, str, dict]]:
    auth = {"Authorization": f"Bearer {api_key}"}
    chat = {"model": "tessera-demo", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    return [("GET", "/v1/models", {"headers": auth}),
            ("POST", "/v1/chat/completions", {"headers": auth, "json": chat}),
            ("POST", "/v1/chat/completions", {"headers": auth, "json": {**chat, "stream": True}}),
            ("POST", "/v1/completions", {"headers": auth, "json": {"model": "tessera-demo", "prompt": "hi"}}),
            ("GET", "/metrics", {})]


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
