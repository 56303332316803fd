"""The dashboard in headless Debian Chromium against a live web server: charts drawn with data, and the
live engine panel updating from a heartbeat this test publishes in Redis (no engine worker needed).

The stack runs in its own processes (own redis-server, SQLite file with 30 days of synthetic usage,
a real engine worker on the tiny model, the web server serving the ASGI app and WhiteNoise static files from
`make assets`); the test also plays a second worker by writing heartbeats to that Redis itself.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis
from dashboard_testing import clear_heartbeat, fake_heartbeat

from inference import protocol as redis_keys
from inference.fairness import ServiceWindow
from tessera import embedded_redis
from tessera.embedded_redis import free_port
from tessera.run import WEB_SERVERS, web_command
from tests.platform.browser_output import CHROMIUM, headless_chromium, save_screenshot

REPO = Path(__file__).resolve().parents[3]
CHARTS = [
    "chart-tokens",
    "chart-sources",
    "chart-models",
    "chart-model-share",
    "chart-source-share",
    "chart-ttft",
    "chart-tpot",
    "chart-e2e",
    "chart-errors",
]

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not Path(CHROMIUM).exists(), reason="Debian chromium missing: run `make browser`"),
]


ENGINE_ARGS = {
    "dtype": "float32",
    "device": "cpu",
    "block_size": 16,
    "max_num_seqs": 8,
    "max_num_batched_tokens": 256,
    "max_model_len": 256,
    "num_kv_blocks": 96,
    "seed": 0,
}


# An engine error now: the error chart has a point in the current hour whatever the synthetic data holds (on a
# weekend its last 24 hours can hold none, and a request refused by validation leaves no usage row).
RECORD_AN_ENGINE_ERROR = """
from django.contrib.auth import get_user_model
from usage.services import record_usage
user = get_user_model().objects.filter(username__startswith="demo-user-").first()
record_usage(user=user, source="api", model="tiny-llama", status_code=500, error_code="engine_error", latency_ms=40.0)
"""


@dataclass
class Server:
    url: str
    redis_url: str
    env: dict
    api_key: str


def _env(tmp_path: Path, redis_url: str, model_dir: str) -> dict:
    return {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "tessera.settings.dev",
        "DEBUG": "1",
        "DATABASE_URL": f"sqlite:///{tmp_path / 'db.sqlite3'}",
        "REDIS_URL": redis_url,
        "ALLOWED_HOSTS": "127.0.0.1,localhost",
        "PYTHONPATH": f"{REPO}{os.pathsep}{REPO / 'platform'}",
        "DJANGO_SUPERUSER_PASSWORD": "staff-pw-123",
        "MODEL": model_dir,
        "SERVED_MODEL_NAME": "tiny-llama",
        "ENGINE_ARGS": json.dumps(ENGINE_ARGS),
        "ENGINE_HEARTBEAT_INTERVAL": "0.5",
        "ENGINE_DRAIN_TIMEOUT": "1",
        "PYTHONUNBUFFERED": "1",
    }


def _manage(env, *args) -> str:
    done = subprocess.run(
        [sys.executable, "manage.py", *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, f"manage.py {args[0]} failed:\n{done.stdout}\n{done.stderr}"
    return done.stdout


def _spawn(env, log_path: Path, *cmd) -> subprocess.Popen:
    return subprocess.Popen(
        list(cmd), cwd=REPO, env=env, stdout=open(log_path, "wb"), stderr=subprocess.STDOUT, start_new_session=True
    )


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(5)


def _wait(condition, what: str, procs: dict, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for name, (proc, log) in procs.items():
            if proc.poll() is not None:
                raise RuntimeError(f"{name} exited: {log.read_text(errors='replace')[-3000:]}")
        try:
            if condition():
                return
        except (OSError, redis.RedisError):
            pass
        time.sleep(0.3)
    raise RuntimeError(f"{what} not ready within {timeout}s")


def _answers(url: str) -> bool:
    try:
        urllib.request.urlopen(url, timeout=1)
    except urllib.error.HTTPError:
        pass  # it answers (404 for anonymous is what we expect)
    return True


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_model_dir):
    """Own redis-server, SQLite file with 30 days of usage, a real engine worker, and the web server."""
    assert (REPO / "var/assets/vendor/chart.umd.min.js").exists(), "chart.js missing: run `make assets`"
    tmp = tmp_path_factory.mktemp("dashboard-live")
    redis_url, redis_proc = embedded_redis.start(data_dir=str(tmp))
    env = _env(tmp, redis_url, tiny_model_dir)
    procs = {}
    try:
        _manage(env, "migrate", "--noinput")
        _manage(
            env,
            "generate_usage",
            "--days",
            "30",
            "--users",
            "10",
            "--requests-per-day",
            "500",
            "--seed",
            "5",
            "--batches",
            "10",
        )
        _manage(env, "shell", "-c", RECORD_AN_ENGINE_ERROR)
        _manage(env, "createsuperuser", "--noinput", "--username", "staff", "--email", "staff@example.com")
        api_key = _manage(env, "create_api_key", "staff", "--name", "browser-test").strip().splitlines()[-1]
        procs["engine"] = (_spawn(env, tmp / "engine.log", sys.executable, "manage.py", "engine"), tmp / "engine.log")
        port = free_port()
        procs["web"] = (_spawn(env, tmp / "web.log", *web_command(WEB_SERVERS[0], port=port)), tmp / "web.log")
        url = f"http://127.0.0.1:{port}"
        _wait(lambda: _answers(url + "/dashboard/"), "the web server", procs)
        r = redis.Redis.from_url(redis_url)
        _wait(lambda: r.smembers(redis_keys.WORKERS_SET), "the engine worker", procs)
        yield Server(url=url, redis_url=redis_url, env=env, api_key=api_key)
    finally:
        for proc, _ in procs.values():
            _stop(proc)
        redis_proc.terminate()


def _fake_tenant_shares() -> dict:
    """The second worker's last minute of service, in the engine's own format (its ServiceWindow)."""
    window = ServiceWindow(clock=lambda: 1000.0)
    window.add("fake-tenant", 500, 3.0)
    window.add(None, 100, 1.0)
    return window.shares()


FAKE_TENANT_SHARES = _fake_tenant_shares()


class HeartbeatPublisher(threading.Thread):
    """Plays a second engine worker: a new heartbeat every 0.4 s with a changing load."""

    def __init__(self, worker_id: str, redis_url: str):
        super().__init__(daemon=True)
        self.worker_id, self.redis_url = worker_id, redis_url
        self.stopped, self.beats = threading.Event(), 0

    def run(self):
        pattern = "3322222211110000"
        while not self.stopped.is_set():
            self.beats += 1
            n = self.beats
            states = (pattern * 12)[n % 16 :][:160]
            fake_heartbeat(
                self.worker_id,
                running=n % 7 + 1,
                waiting=n % 3,
                kv_usage=0.3 + (n % 5) / 10,
                tokens_per_s=80.0 + 7 * (n % 9),
                states=states,
                redis_url=self.redis_url,
                tenant_shares=FAKE_TENANT_SHARES,
                spec_decode=(10, 40, 30),
            )
            self.stopped.wait(0.4)


@pytest.fixture
def heartbeat(server):
    publisher = HeartbeatPublisher(f"fake-worker-{os.getpid()}", server.redis_url)
    publisher.start()
    yield publisher
    publisher.stopped.set()
    publisher.join(5)
    clear_heartbeat(publisher.worker_id, server.redis_url)


@pytest.fixture
def traffic(server):
    """Chat requests to the real worker through the API while the page watches."""
    import openai

    client = openai.OpenAI(base_url=server.url + "/v1", api_key=server.api_key, max_retries=0)
    stop = threading.Event()

    def run():
        while not stop.is_set():
            try:
                client.chat.completions.create(
                    model="tiny-llama",
                    max_tokens=48,
                    temperature=0.0,
                    messages=[{"role": "user", "content": "Tell me about paged attention"}],
                )
            except openai.OpenAIError:
                stop.wait(0.5)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    yield
    stop.set()
    thread.join(30)


def _chart_points(page, chart_id: str) -> int:
    """Number of non-zero data points Chart.js holds for the canvas (0 if no chart was drawn)."""
    return page.evaluate(
        """(id) => {
        const chart = Chart.getChart(id);
        if (!chart) return 0;
        return chart.data.datasets.flatMap((d) => d.data).filter((v) => typeof v === 'number' && v > 0).length;
    }""",
        chart_id,
    )


def test_dashboard_renders_charts_and_live_engine_panel(server, heartbeat, traffic):
    live_server_url = server.url
    with headless_chromium() as browser:
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        errors = []
        page.on("pageerror", lambda exc: errors.append(str(exc)))
        # Anonymous: the dashboard does not exist.
        assert page.goto(f"{live_server_url}/dashboard/").status == 404
        page.goto(f"{live_server_url}/admin/login/?next=/dashboard/")
        page.fill("#id_username", "staff")
        page.fill("#id_password", "staff-pw-123")
        page.click("input[type=submit]")
        page.wait_for_url(f"{live_server_url}/dashboard/")

        page.wait_for_function(
            "Number(document.getElementById('dashboard').dataset.usageLoaded || 0) >= 1", timeout=30000
        )
        for chart_id in CHARTS:
            assert _chart_points(page, chart_id) > 0, chart_id
        assert page.locator("#top-users tbody tr").count() >= 5
        assert _chart_points(page, "chart-batches") >= 4  # in_progress, completed, failed, cancelled...
        assert "Oldest running: batch_" in page.inner_text("#batch-oldest")
        assert page.locator("#top-users tbody a").first.inner_text().startswith("demo-user-")

        page.click("button[data-range='30d']")
        page.wait_for_function("Number(document.getElementById('dashboard').dataset.usageLoaded) >= 2", timeout=30000)
        assert page.evaluate("Chart.getChart('chart-tokens').data.labels.length") == 30

        # Live panel: ticks arrive over the websocket and the numbers follow the heartbeat.
        page.wait_for_function(
            "Number(document.getElementById('dashboard').dataset.liveTicks || 0) >= 2", timeout=20000
        )
        seen = set()
        deadline = time.monotonic() + 10
        while len(seen) < 3 and time.monotonic() < deadline:
            seen.add(page.inner_text("#live-running"))
            page.wait_for_timeout(300)
        assert len(seen) >= 3, f"live panel did not change: {seen}"
        assert page.locator(f"[data-worker='{heartbeat.worker_id}'] .grid .b").count() == 160
        assert page.locator(f"[data-worker='{heartbeat.worker_id}'] .grid .b.s").count() > 0
        assert heartbeat.worker_id in page.inner_text("#workers-table")
        assert _chart_points(page, "chart-live") > 0
        assert "GiB" in page.inner_text("#workers-table")  # the fake worker's memory budget
        # The fake worker speculates (30 of 40 proposed accepted over 10 verifications); the real one does not.
        assert page.inner_text("#live-spec") == "75.0% / 4.00"
        # Fair share: the fake worker's tenant with its weight, and the staff user's own traffic as the
        # real worker served it (the tenant is the user id; the panel shows the username).
        fake_row = page.locator("#tenant-shares tbody tr", has_text="fake-tenant").locator("td").all_inner_texts()
        assert fake_row[0] == "fake-tenant" and fake_row[1] == "500" and fake_row[3] == "3", fake_row
        page.wait_for_function(
            "[...document.querySelectorAll('#tenant-shares tbody tr td:first-child')]"
            ".some((td) => td.textContent === 'staff')",
            timeout=60000,
        )

        # The real engine worker: its heartbeat, start-up memory budget and its 96-block KV map.
        real = next(
            w
            for w in page.evaluate("window.tesseraDashboard.state.lastSnapshot.workers")
            if w["model"] == "tiny-llama" and not w["worker_id"].startswith("fake-worker-")
        )
        assert real["memory"]["num_kv_blocks"] == ENGINE_ARGS["num_kv_blocks"]
        assert page.locator(f"[data-worker='{real['worker_id']}'] .grid .b").count() == ENGINE_ARGS["num_kv_blocks"]
        assert "kv pool" in page.inner_text("#workers-table")
        page.wait_for_function(
            "window.tesseraDashboard.state.lastSnapshot.workers.some("
            "(w) => !w.worker_id.startsWith('fake-worker-') && w.tokens_per_s > 0)",
            timeout=60000,
        )

        save_screenshot(page, "dashboard", full_page=True)

        # Drill-down: a top user's own page, charts drawn from that user's usage only.
        page.click("#top-users tbody a >> nth=0")
        page.wait_for_url("**/dashboard/users/*/")
        page.wait_for_function(
            "Number(document.getElementById('dashboard').dataset.usageLoaded || 0) >= 1", timeout=30000
        )
        for chart_id in ("chart-tokens", "chart-model-share", "chart-ttft", "chart-e2e"):
            assert _chart_points(page, chart_id) > 0, chart_id
        assert "demo-user-" in page.inner_text(".dash-head h1")
        assert not errors, errors
