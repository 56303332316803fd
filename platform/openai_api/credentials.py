"""Who a /v1 request is: its API key's row, the key's user and their plan, cached in each web process.

Looking them up took two ORM queries, about half of an admission (docs/architecture.md). Every save or
delete of an ApiKey, a User, a Plan or a UserPlan empties this process's cache at once and, once it
commits, moves a counter in Redis that every lookup reads (one GET), so a revoked key, a deactivated
user or a changed plan is refused or applied by every web process on its next request. Only accepted
keys are cached: a refused one is looked up again every time.
"""

from __future__ import annotations

from django.contrib.auth import get_user_model
from django.db import transaction
from django.db.models.signals import post_delete, post_save
from django.utils import timezone

from accounts.models import ApiKey
from accounts.services import KEY_PREFIX, authenticate_api_key, hash_key, is_usable, touch_api_key
from common import connections
from quotas.limits import PlanLimits
from quotas.models import Plan, UserPlan
from quotas.selectors import plan_for

EPOCH_KEY = "tessera:credentials-epoch"
MAX_ENTRIES = 10_000  # distinct live keys one process remembers; past that it starts over
_CHANGED_HERE = object()  # never equal to a value read from Redis: the next lookup starts a new cache

# (the Redis counter's value, key digest -> (key, plan)). A new dict when the counter moves: a
# lookup that loaded rows under the older value stores them into a dict nobody reads any more.
_cache: tuple[object, dict[str, tuple[ApiKey, PlanLimits]]] = (_CHANGED_HERE, {})


def caller(raw: str | None) -> tuple[ApiKey, PlanLimits] | None:
    """The usable key `raw` names and its user's plan, or None (the API answers 401)."""
    if not raw or not raw.startswith(KEY_PREFIX):
        return None
    digest, entries, now = hash_key(raw), _entries(), timezone.now()
    known = entries.get(digest)
    if known is not None and is_usable(known[0], now):
        touch_api_key(known[0], now)
        return known
    key = authenticate_api_key(raw)
    if key is None:
        return None
    if len(entries) >= MAX_ENTRIES:
        entries.clear()
    known = entries[digest] = (key, plan_for(key.user))
    return known


def _entries() -> dict:
    global _cache
    epoch = connections.sync_redis().get(EPOCH_KEY)
    if _cache[0] != epoch:
        _cache = (epoch, {})
    return _cache[1]


def forget(**_kwargs) -> None:
    """A credential changed: this process forgets now, every process once the change commits."""
    global _cache
    _cache = (_CHANGED_HERE, {})
    transaction.on_commit(lambda: connections.sync_redis().incr(EPOCH_KEY), robust=True)


def connect_signals() -> None:
    for model in (ApiKey, get_user_model(), Plan, UserPlan):
        post_save.connect(forget, sender=model, dispatch_uid=f"credentials-save-{model._meta.label}")
        post_delete.connect(forget, sender=model, dispatch_uid=f"credentials-delete-{model._meta.label}")
