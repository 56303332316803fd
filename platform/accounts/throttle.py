"""Login attempt limits in Redis, shared by every web process: per username and per client address."""
from __future__ import annotations

import redis
from django.conf import settings

WINDOW_S = 15 * 60
_clients: dict[str, redis.Redis] = {}


def _redis() -> redis.Redis:
    url = settings.REDIS_URL
    if url not in _clients:
        _clients[url] = redis.Redis.from_url(url)
    return _clients[url]


def _keys(username: str, address: str) -> list[str]:
    return [f"login:fail:user:{username.strip().lower()}", f"login:fail:ip:{address}"]


def client_address(request) -> str:
    return request.META.get("REMOTE_ADDR") or "unknown"


def is_locked(username: str, address: str) -> int:
    """Seconds until another attempt is allowed, or 0 when attempts are allowed now."""
    limit = getattr(settings, "LOGIN_ATTEMPTS_PER_15_MIN", 10)
    r = _redis()
    for key in _keys(username, address):
        if int(r.get(key) or 0) >= limit:
            return max(1, r.ttl(key))
    return 0


def record_failure(username: str, address: str) -> None:
    pipe = _redis().pipeline()
    for key in _keys(username, address):
        pipe.set(key, 0, ex=WINDOW_S, nx=True)  # the window starts at the first failure
        pipe.incr(key)  # INCR keeps the TTL
    pipe.execute()


def record_success(username: str, address: str) -> None:
    _redis().delete(_keys(username, address)[0])
