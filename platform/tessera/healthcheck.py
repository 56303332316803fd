"""Container health checks (compose.yaml): `python -m tessera.healthcheck web|engine`.

Exit status 0 = healthy. Both checks are cheap and need no Django start-up:
- web: the web server's port (PORT, default 8000) accepts connections. Not /health, which is 503
  while no engine worker is up: the web tier itself is fine then and must stay in rotation.
- engine: this worker's heartbeat key exists in Redis (ENGINE_WORKER_ID; any live worker when
  unset). The heartbeat expires a few seconds after the worker stops stepping.
"""

from __future__ import annotations

import os
import socket
import sys


def web_ok(env=os.environ) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", int(env.get("PORT", "8000"))), timeout=2):
            return True
    except OSError:
        return False


def engine_ok(env=os.environ) -> bool:
    import redis

    from inference import protocol

    client = redis.Redis.from_url(env.get("REDIS_URL", "redis://127.0.0.1:6379/0"), socket_timeout=2)
    try:
        worker_id = env.get("ENGINE_WORKER_ID")
        if worker_id:
            return bool(client.exists(protocol.heartbeat_key(worker_id)))
        ids = [m.decode() for m in client.smembers(protocol.WORKERS_SET)]
        return any(client.exists(protocol.heartbeat_key(w)) for w in ids)
    except redis.RedisError:
        return False


CHECKS = {"web": web_ok, "engine": engine_ok}


def main(argv: list[str]) -> int:
    if len(argv) != 1 or argv[0] not in CHECKS:
        print(f"usage: python -m tessera.healthcheck {'|'.join(CHECKS)}", file=sys.stderr)
        return 2
    healthy = CHECKS[argv[0]]()
    print(f"{argv[0]}: {'healthy' if healthy else 'unhealthy'}")
    return 0 if healthy else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
