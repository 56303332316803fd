"""The web server (as `make run` starts it) on the real ASGI app (dev settings), with its own SQLite
file and a redis-server a test may stop."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import httpx

from tessera import embedded_redis
from tessera.run import WEB_SERVERS, web_command
from tessera.web import GRACEFUL_SHUTDOWN_S

REPO_DIR = Path(__file__).resolve().parents[3]
USERNAME, PASSWORD = "outage", "pw-long-enough-1"


class Server:
    """The web server serving tessera.asgi:application for one test; start() migrates, makes a user and an API key."""

    def __init__(self, work_dir: Path, **env: str):
        self.work_dir = work_dir
        self.redis_url, self.redis = embedded_redis.start(data_dir=str(work_dir))
        self.redis_port = int(self.redis_url.rsplit(":", 1)[1].split("/")[0])
        self.port = embedded_redis.free_port()
        self.env = {
            **os.environ,
            "DJANGO_SETTINGS_MODULE": "tessera.settings.dev",
            "DEBUG": "1",
            "REDIS_URL": self.redis_url,
            "DATABASE_URL": f"sqlite:///{work_dir / 'db.sqlite3'}",
            "TESSERA_VAR_DIR": str(work_dir),
            "PYTHONPATH": f"{REPO_DIR}{os.pathsep}{REPO_DIR / 'platform'}",
            **env,
        }
        self.log_path = work_dir / "web.log"
        self.web = None

    def manage(self, *args: str) -> str:
        done = subprocess.run(
            [sys.executable, "manage.py", *args],
            cwd=REPO_DIR,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=300,
            check=True,
        )
        return done.stdout

    def start(self) -> str:
        self.manage("migrate", "--noinput")
        self.manage(
            "shell",
            "-c",
            "from django.contrib.auth.models import User; "
            f"User.objects.create_user({USERNAME!r}, password={PASSWORD!r})",
        )
        api_key = self.manage("create_api_key", USERNAME).strip().splitlines()[-1]
        with open(self.log_path, "wb") as log:
            self.web = subprocess.Popen(
                web_command(WEB_SERVERS[0], port=self.port),
                cwd=REPO_DIR,
                env=self.env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            assert self.web.poll() is None, self.log_path.read_text()
            try:
                httpx.get(self.url("/health"), timeout=2)
                return api_key
            except httpx.TransportError:
                time.sleep(0.2)
        raise AssertionError("the web server did not answer within 120 s:\n" + self.log_path.read_text())

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def stop_redis(self) -> None:
        self.redis.terminate()
        self.redis.wait(10)

    def restart_redis(self) -> None:
        _url, self.redis = embedded_redis.start(port=self.redis_port, data_dir=str(self.work_dir))

    def stop(self) -> None:
        if self.web is not None and self.web.poll() is None:
            self.web.terminate()
            # A refused websocket's consumer may still sit in channels_redis's BRPOP (5 s), which
            # uvicorn waits out for at most GRACEFUL_SHUTDOWN_S.
            self.web.wait(GRACEFUL_SHUTDOWN_S + 10)
        if self.redis.poll() is None:
            self.stop_redis()

    def session_cookie(self) -> str:
        """Log in through the real log-in form (CSRF token and all); the Cookie header of that session."""
        with httpx.Client(base_url=self.url(""), timeout=30) as client:
            page = client.get("/accounts/login/")
            token = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', page.text).group(1)
            done = client.post(
                "/accounts/login/", data={"username": USERNAME, "password": PASSWORD, "csrfmiddlewaretoken": token}
            )
            assert done.status_code == 302, done.text[:500]
            return "; ".join(f"{name}={value}" for name, value in client.cookies.items())
