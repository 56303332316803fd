"""Log-in and sign-up limits in Redis, shared by every web process (the site login and /admin/login/).

A lockout must not be a weapon against other people, so the hard lock is per (username, address):
failures from one address lock that address out of that account only, and the owner logging in
from elsewhere is not affected. Two wider counters stop the attacks a pair lock alone lets through:
- one account guessed from many addresses (LOGIN_FAILURES_PER_USERNAME), and
- many accounts guessed from one address (LOGIN_FAILURES_PER_ADDRESS, password spraying);
when either is over its limit, only (username, address) pairs without an earlier successful log-in
are refused. An address that has logged in to an account before (remembered KNOWN_ADDRESS_DAYS)
keeps its way in, so neither counter can lock a user out from where they usually log in. The one
lock an attacker can still cause is for a victim behind the attacker's own address (a shared NAT),
and only after failing the victim's username there LOGIN_ATTEMPTS_PER_15_MIN times.
"""

from __future__ import annotations

import hashlib

from django.conf import settings

from common import connections

WINDOW_S = 15 * 60
KNOWN_ADDRESS_DAYS = 30
SIGNUP_WINDOW_S = 3600


def _user(username: str) -> str:
    """A fixed-length key part: usernames are attacker-chosen strings."""
    return hashlib.sha256(username.strip().lower().encode("utf-8", "replace")).hexdigest()[:32]


def _pair_key(username: str, address: str) -> str:
    return f"login:fail:pair:{_user(username)}:{address}"


def _user_key(username: str) -> str:
    return f"login:fail:user:{_user(username)}"


def _address_key(address: str) -> str:
    return f"login:fail:ip:{address}"


def _known_key(username: str, address: str) -> str:
    return f"login:known:{_user(username)}:{address}"


def client_address(request) -> str:
    return request.META.get("REMOTE_ADDR") or "unknown"


def is_locked(username: str, address: str) -> int:
    """Seconds until another attempt is allowed for this username from this address, or 0."""
    r = connections.sync_redis()
    limits = [(_pair_key(username, address), settings.LOGIN_ATTEMPTS_PER_15_MIN)]
    if not r.exists(_known_key(username, address)):
        limits += [
            (_user_key(username), settings.LOGIN_FAILURES_PER_USERNAME),
            (_address_key(address), settings.LOGIN_FAILURES_PER_ADDRESS),
        ]
    for key, limit in limits:
        if int(r.get(key) or 0) >= limit:
            return max(1, r.ttl(key))
    return 0


def record_failure(username: str, address: str) -> None:
    pipe = connections.sync_redis().pipeline()
    for key in (_pair_key(username, address), _user_key(username), _address_key(address)):
        pipe.set(key, 0, ex=WINDOW_S, nx=True)  # the window starts at the first failure
        pipe.incr(key)  # INCR keeps the TTL
    pipe.execute()


def record_success(username: str, address: str) -> None:
    pipe = connections.sync_redis().pipeline()
    pipe.delete(_pair_key(username, address))
    pipe.set(_known_key(username, address), 1, ex=KNOWN_ADDRESS_DAYS * 86400)
    pipe.execute()


def signup_wait(address: str) -> int:
    """Seconds until this address may create another account, or 0 when it may now."""
    r = connections.sync_redis()
    key = f"signup:ip:{address}"
    if int(r.get(key) or 0) >= settings.SIGNUPS_PER_HOUR_PER_ADDRESS:
        return max(1, r.ttl(key))
    return 0


def record_signup(address: str) -> None:
    pipe = connections.sync_redis().pipeline()
    pipe.set(f"signup:ip:{address}", 0, ex=SIGNUP_WINDOW_S, nx=True)
    pipe.incr(f"signup:ip:{address}")
    pipe.execute()
