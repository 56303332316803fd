"""A live Tessera stack for end-to-end tests: its own redis-server, SQLite file, engine worker, web server.

Reuse from any conftest:

    from tests.platform.live_stack import live_stack  # noqa: F401  (session-scoped fixture)

    def test_something(live_stack):
        client = openai.OpenAI(base_url=live_stack.base_url + "/v1", api_key=live_stack.api_key)

or build one with other settings: `with LiveStack.start(model_dir, tmp_dir, env={...}, celery=True) as stack:`.
Every child runs in its own process group and is killed at teardown (also when start-up fails).
The stack's database is a separate SQLite file (stack.db_path; query it with stack.sql(...)), so
tests must not expect rows written in-process by pytest-django to be visible to the server.
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import redis

from tessera import embedded_redis
from tessera.run import WEB_SERVERS, web_command

REPO_DIR = Path(__file__).resolve().parents[2]
BIN_DIR = Path(sys.executable).parent
ENGINE_ARGS = {
    "dtype": "float32",
    "device": "cpu",
    "block_size": 16,
    "max_num_seqs": 16,
    "max_num_batched_tokens": 512,
    "max_model_len": 512,
    "num_kv_blocks": 128,
    "seed": 0,
}
GENEROUS_QUOTAS = {
    "QUOTA_TOKENS_PER_DAY": "100000000",
    "QUOTA_TOKENS_PER_MONTH": "1000000000",
    "QUOTA_REQUESTS_PER_MINUTE": "100000",
    "QUOTA_CONCURRENT_REQUESTS": "1000",
    "QUOTA_MAX_TOKENS_PER_REQUEST": "100000",
}
USERNAME = "live"
PASSWORD = "live-password-123"


@dataclass
class LiveStack:
    base_url: str
    redis_url: str
    db_path: Path
    api_key: str
    username: str
    password: str
    model_name: str
    log_dir: Path
    env: dict
    processes: dict[str, subprocess.Popen] = field(default_factory=dict)

    # ---------------------------------------------------------------- start / stop

    @classmethod
    def start(
        cls,
        model_dir: str,
        work_dir: Path,
        *,
        env: dict | None = None,
        engine_args: dict | None = None,
        celery: bool = False,
        workers: int = 1,
        timeout: float = 240.0,
        web_server: str = WEB_SERVERS[0],
    ) -> "LiveStack":
        work_dir = Path(work_dir)
        work_dir.mkdir(parents=True, exist_ok=True)
        redis_url, redis_proc = embedded_redis.start(data_dir=str(work_dir))
        child_env = {
            **os.environ,
            **GENEROUS_QUOTAS,
            "DJANGO_SETTINGS_MODULE": "tessera.settings.test",
            "REDIS_URL": redis_url,
            "DATABASE_URL": f"sqlite:///{work_dir / 'db.sqlite3'}",
            "TESSERA_VAR_DIR": str(work_dir),
            "MODEL": model_dir,
            "SERVED_MODEL_NAME": "tiny-llama",
            "ENGINE_ARGS": json.dumps({**ENGINE_ARGS, **(engine_args or {})}),
            "ENGINE_HEARTBEAT_TTL": "3",
            "ENGINE_HEARTBEAT_INTERVAL": "0.25",
            "ENGINE_DRAIN_TIMEOUT": "2",
            "PYTHONPATH": f"{REPO_DIR}{os.pathsep}{REPO_DIR / 'platform'}",
            "PYTHONUNBUFFERED": "1",
            **(env or {}),
        }
        port = embedded_redis.free_port()
        stack = cls(
            base_url=f"http://127.0.0.1:{port}",
            redis_url=redis_url,
            db_path=work_dir / "db.sqlite3",
            api_key="",
            username=USERNAME,
            password=PASSWORD,
            model_name=child_env["SERVED_MODEL_NAME"],
            log_dir=work_dir,
            env=child_env,
        )
        stack.processes["redis"] = redis_proc
        atexit.register(stack.stop)  # also when a test run is interrupted
        try:
            stack.manage("migrate", "--noinput")
            stack.manage(
                "shell",
                "-c",
                "from django.contrib.auth.models import User; "
                f"User.objects.create_user({USERNAME!r}, password={PASSWORD!r})",
            )
            stack.api_key = stack.manage("create_api_key", USERNAME, "--name", "live").strip().splitlines()[-1]
            for i in range(workers):
                stack.spawn(f"engine{i}", [sys.executable, "manage.py", "engine"])
            if celery:
                stack.spawn(
                    "celery",
                    [
                        str(BIN_DIR / "celery"),
                        "-A",
                        "tessera",
                        "worker",
                        "-l",
                        "info",
                        "-c",
                        "2",
                        "--without-gossip",
                        "--without-mingle",
                    ],
                )
            stack.spawn("web", web_command(web_server, host="127.0.0.1", port=port))
            stack.wait_healthy(timeout, workers)
        except BaseException:
            stack.stop()
            raise
        return stack

    def manage(self, *args: str) -> str:
        done = subprocess.run(
            [sys.executable, "manage.py", *args],
            cwd=REPO_DIR,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        if done.returncode != 0:
            raise RuntimeError(f"manage.py {' '.join(args)} failed:\n{done.stdout}\n{done.stderr}")
        return done.stdout

    def spawn(self, name: str, cmd: list[str], env: dict | None = None) -> subprocess.Popen:
        log = open(self.log_dir / f"{name}.log", "wb")
        proc = subprocess.Popen(
            cmd,
            cwd=REPO_DIR,
            env={**self.env, **(env or {})},
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self.processes[name] = proc
        return proc

    def log_tail(self, name: str, lines: int = 40) -> str:
        path = self.log_dir / f"{name}.log"
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.exists() else ""

    def wait_healthy(self, timeout: float, workers: int = 1) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for name, proc in self.processes.items():
                if proc.poll() is not None:
                    raise RuntimeError(f"{name} exited with {proc.returncode}:\n{self.log_tail(name)}")
            try:
                with urllib.request.urlopen(self.base_url + "/health", timeout=2) as response:
                    if len(json.load(response)["workers"]) >= workers:
                        return
            except (urllib.error.URLError, ConnectionError, OSError, ValueError):
                pass
            time.sleep(0.3)
        logs = "\n".join(f"--- {n}\n{self.log_tail(n)}" for n in self.processes if n != "redis")
        raise RuntimeError(f"the live stack was not healthy within {timeout}s\n{logs}")

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        """Signal one child's whole process group (celery's pool children included) and reap it."""
        proc = self.processes.pop(name, None)
        if proc is None or proc.poll() is not None:
            return
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)

    def stop(self) -> None:
        for name in [n for n in self.processes if n != "redis"]:
            self.kill(name, signal.SIGTERM)
        self.kill("redis", signal.SIGTERM)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()

    # ---------------------------------------------------------------- helpers for tests

    def redis(self) -> redis.Redis:
        return redis.Redis.from_url(self.redis_url)

    def sql(self, query: str, params: tuple = ()) -> list[tuple]:
        with sqlite3.connect(self.db_path, timeout=10) as db:
            return db.execute(query, params).fetchall()

    def worker_stats(self) -> list[dict]:
        r = self.redis()
        stats = []
        for worker_id in r.smembers("tessera:engine:workers"):
            raw = r.hget(f"tessera:engine:worker:{worker_id.decode()}", "stats")
            if raw:
                stats.append(json.loads(raw))
        return stats


def real_model_stack(tmp_path_factory, name: str, engine_args: dict) -> LiveStack:
    """A live stack on the bundled default model: MODEL and SERVED_MODEL_NAME empty, so the settings
    resolve the SmolLM2 file and its name, as `make run` does. Use it as a context manager."""
    env = {"MODEL": "", "SERVED_MODEL_NAME": "", "TESSERA_CACHE_DIR": str(tmp_path_factory.mktemp("cache"))}
    return LiveStack.start("", tmp_path_factory.mktemp(name), env=env, engine_args=engine_args)


@pytest.fixture(scope="session")
def live_stack(tiny_model_dir, tmp_path_factory):
    """the web server + one `manage.py engine` worker (tiny model) + private redis-server + SQLite, for the session."""
    with LiveStack.start(tiny_model_dir, tmp_path_factory.mktemp("live-stack")) as stack:
        yield stack
