"""API keys. Users are Django's default auth.User; the raw key is shown once and stored only hashed."""

from django.conf import settings
from django.db import models
from django.utils import timezone


class ApiKey(models.Model):
    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="api_keys")
    name = models.CharField(max_length=100, blank=True)
    prefix = models.CharField(max_length=16, db_index=True, help_text="the key's visible start, e.g. tsk-ab12cd34")
    hashed_key = models.CharField(max_length=64, unique=True, help_text="sha256 hex of the whole key")
    created_at = models.DateTimeField(auto_now_add=True)
    last_used_at = models.DateTimeField(null=True, blank=True)
    expires_at = models.DateTimeField(null=True, blank=True)
    revoked_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-created_at"]

    def __str__(self) -> str:
        return f"{self.prefix}… ({self.name or 'unnamed'}, {self.user})"

    @property
    def is_revoked(self) -> bool:
        return self.revoked_at is not None

    def is_expired(self, now=None) -> bool:
        return self.expires_at is not None and self.expires_at <= (now or timezone.now())

    def is_active(self, now=None) -> bool:
        return not self.is_revoked and not self.is_expired(now)
