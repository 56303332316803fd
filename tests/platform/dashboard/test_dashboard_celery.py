"""The roll-up runs in a real Celery worker (own redis-server broker, own SQLite file), twice, with
the same result: what celery beat triggers every five minutes in `make run` and compose."""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest
from celery import Celery

from tessera import embedded_redis

REPO = Path(__file__).resolve().parents[3]
pytestmark = pytest.mark.slow


def _manage(env, *args):
    done = subprocess.run(
        [sys.executable, "manage.py", *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stdout + done.stderr


def _rollup_rows(db: Path) -> tuple[str | None, int, int]:
    with sqlite3.connect(db) as conn:
        state = conn.execute("select rolled_until from dashboard_rollupstate").fetchone()
        hourly = conn.execute("select count(*), coalesce(sum(requests), 0) from dashboard_usagehourly").fetchone()
    return (state[0] if state else None, *hourly)


def _wait_for(predicate, proc, log: Path, timeout=120):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, log.read_text(errors="replace")[-3000:]
        if predicate():
            return
        time.sleep(0.3)
    raise AssertionError(f"timed out; worker log:\n{log.read_text(errors='replace')[-3000:]}")


def test_roll_up_task_in_a_real_worker_is_idempotent(tmp_path):
    redis_url, redis_proc = embedded_redis.start(data_dir=str(tmp_path))
    db = tmp_path / "db.sqlite3"
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "tessera.settings.dev",
        "DATABASE_URL": f"sqlite:///{db}",
        "REDIS_URL": redis_url,
        "PYTHONPATH": f"{REPO}{os.pathsep}{REPO / 'platform'}",
    }
    _manage(env, "migrate", "--noinput")
    _manage(env, "generate_usage", "--days", "1", "--users", "2", "--requests-per-day", "200", "--no-rollup")
    assert _rollup_rows(db) == (None, 0, 0)

    log = tmp_path / "celery.log"
    worker = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "celery",
            "-A",
            "tessera",
            "worker",
            "--pool",
            "solo",
            "--without-gossip",
            "--without-mingle",
            "-l",
            "info",
        ],
        cwd=REPO,
        env=env,
        stdout=open(log, "wb"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        sender = Celery(broker=redis_url)
        sender.send_task("dashboard.roll_up_usage")
        _wait_for(lambda: _rollup_rows(db)[0] is not None, worker, log)
        first = _rollup_rows(db)
        with sqlite3.connect(db) as conn:  # Django stores UTC as "YYYY-MM-DD HH:MM:SS[.ffffff]" text
            before_watermark = conn.execute(
                "select count(*) from usage_usagerecord where created_at < ?", (first[0],)
            ).fetchone()[0]
        assert first[2] == before_watermark > 0  # every complete hour's requests, none of the current hour

        sender.send_task("dashboard.roll_up_usage")
        _wait_for(lambda: log.read_text(errors="replace").count("succeeded") >= 2, worker, log)
        assert _rollup_rows(db) == first
    finally:
        os.killpg(worker.pid, signal.SIGTERM)
        worker.wait(20)
        redis_proc.terminate()
