"""Writes for API keys: create (the raw key is returned once), authenticate, revoke."""

from __future__ import annotations

import hashlib
import secrets
from datetime import timedelta

from django.utils import timezone

from .models import ApiKey

KEY_PREFIX = "tsk-"
PREFIX_LENGTH = len(KEY_PREFIX) + 8
LAST_USED_RESOLUTION = timedelta(seconds=60)  # at most one last_used_at write per key a minute


def hash_key(raw: str) -> str:
    return hashlib.sha256(raw.encode()).hexdigest()


def create_api_key(user, name: str = "", expires_at=None) -> tuple[ApiKey, str]:
    """Create a key for `user`; returns (ApiKey, raw key). The raw key is never stored."""
    raw = KEY_PREFIX + secrets.token_urlsafe(32)
    key = ApiKey.objects.create(
        user=user, name=name, prefix=raw[:PREFIX_LENGTH], hashed_key=hash_key(raw), expires_at=expires_at
    )
    return key, raw


def authenticate_api_key(raw: str | None) -> ApiKey | None:
    """The active key matching `raw` (and its active user), or None. Touches last_used_at."""
    if not raw or not raw.startswith(KEY_PREFIX):
        return None
    key = ApiKey.objects.select_related("user").filter(hashed_key=hash_key(raw)).first()
    now = timezone.now()
    if key is None or not is_usable(key, now):
        return None
    touch_api_key(key, now)
    return key


def is_usable(key: ApiKey, now) -> bool:
    """Neither revoked nor expired, and its user still active."""
    return key.is_active(now) and key.user.is_active


def touch_api_key(key: ApiKey, now) -> None:
    """Record the key's use: at most one write per LAST_USED_RESOLUTION (an update, so no save signal)."""
    if key.last_used_at is None or now - key.last_used_at > LAST_USED_RESOLUTION:
        ApiKey.objects.filter(pk=key.pk).update(last_used_at=now)
        key.last_used_at = now


def revoke_api_key(key: ApiKey) -> ApiKey:
    """Revoke a key (idempotent: the first revocation time is kept)."""
    if key.revoked_at is None:
        key.revoked_at = timezone.now()
        key.save(update_fields=["revoked_at"])
    return key
