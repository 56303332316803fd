"""Reads for API keys."""

from django.db.models import QuerySet

from .models import ApiKey


def api_keys_for(user) -> QuerySet[ApiKey]:
    """A user's keys, newest first (revoked ones included; callers filter if they want)."""
    return ApiKey.objects.filter(user=user).order_by("-created_at")


def api_key_for(user, key_id) -> ApiKey | None:
    """One of the user's own keys, or None (never another user's)."""
    return ApiKey.objects.filter(user=user, pk=key_id).first()
