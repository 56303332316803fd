"""Container health checks (python -m tessera.healthcheck) against a real socket and a real Redis."""

import socket
import subprocess
import sys
from pathlib import Path

import redis
from django.conf import settings

from inference import protocol
from tessera import healthcheck
from tessera.embedded_redis import free_port


def test_web_is_healthy_while_its_port_accepts_connections():
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        assert healthcheck.web_ok({"PORT": str(server.getsockname()[1])})
    assert not healthcheck.web_ok({"PORT": str(free_port())})


def test_engine_is_healthy_only_while_its_heartbeat_exists():
    client = redis.Redis.from_url(settings.REDIS_URL)
    env = {"REDIS_URL": settings.REDIS_URL, "ENGINE_WORKER_ID": "hc-test-worker"}
    key = protocol.heartbeat_key("hc-test-worker")
    client.delete(key)
    assert not healthcheck.engine_ok(env)
    client.hset(key, mapping={"worker_id": "hc-test-worker"})
    client.expire(key, 30)
    try:
        assert healthcheck.engine_ok(env)
        client.sadd(protocol.WORKERS_SET, "hc-test-worker")
        assert healthcheck.engine_ok({"REDIS_URL": settings.REDIS_URL})  # any live worker
    finally:
        client.delete(key)
        client.srem(protocol.WORKERS_SET, "hc-test-worker")


def test_an_unreachable_redis_is_unhealthy():
    assert not healthcheck.engine_ok({"REDIS_URL": f"redis://127.0.0.1:{free_port()}/0"})


def test_command_line_exit_status():
    platform_dir = str(Path(__file__).resolve().parents[2] / "platform")
    bad = subprocess.run(
        [sys.executable, "-m", "tessera.healthcheck", "nope"],
        capture_output=True,
        text=True,
        env={"PYTHONPATH": platform_dir},
    )
    assert bad.returncode == 2 and "usage" in bad.stderr
    down = subprocess.run(
        [sys.executable, "-m", "tessera.healthcheck", "web"],
        capture_output=True,
        text=True,
        env={"PORT": str(free_port()), "PYTHONPATH": platform_dir},
    )
    assert down.returncode == 1 and "unhealthy" in down.stdout
