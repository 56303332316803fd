"""Hourly usage roll-ups: what the dashboard reads instead of scanning every usage row."""

from django.conf import settings
from django.db import models


class UsageHourly(models.Model):
    """Usage of one (user, API key, model, source) in one UTC hour.

    The API key is part of the grain so "top API keys" also comes from roll-ups; a playground or
    batch row without a key has api_key_id NULL. Latency histograms are sparse bucket counts of
    dashboard.histogram (mergeable, bounded relative error), in milliseconds; only successful
    requests are counted in them.
    """

    hour = models.DateTimeField(db_index=True)
    user = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, on_delete=models.CASCADE, related_name="+")
    # A plain id, not a foreign key: keys live in another app and a revoked key's usage stays.
    api_key_id = models.BigIntegerField(null=True, blank=True, db_index=True)
    model = models.CharField(max_length=200)
    source = models.CharField(max_length=32)

    requests = models.PositiveIntegerField(default=0)
    errors = models.PositiveIntegerField(default=0, help_text="responses with status >= 400, 429s included")
    rate_limited = models.PositiveIntegerField(default=0, help_text="responses with status 429")
    prompt_tokens = models.PositiveBigIntegerField(default=0)
    completion_tokens = models.PositiveBigIntegerField(default=0)
    cached_tokens = models.PositiveBigIntegerField(default=0)

    ttft_ms_sum = models.FloatField(default=0.0)
    latency_ms_sum = models.FloatField(default=0.0)
    ttft_hist = models.JSONField(default=dict, blank=True)
    tpot_hist = models.JSONField(default=dict, blank=True)
    latency_hist = models.JSONField(default=dict, blank=True)

    class Meta:
        verbose_name = "hourly usage"
        verbose_name_plural = "hourly usage"
        ordering = ["-hour"]
        indexes = [models.Index(fields=["user", "hour"]), models.Index(fields=["model", "hour"])]

    def __str__(self) -> str:
        return f"{self.hour:%Y-%m-%d %H}:00 user={self.user_id} {self.model}/{self.source}"

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


class LatencyHourly(models.Model):
    """The latency histograms of UsageHourly merged over users and keys: one row per (hour, model,
    source), so overview percentiles over a month merge hundreds of rows, not one per user and hour."""

    hour = models.DateTimeField()
    model = models.CharField(max_length=200)
    source = models.CharField(max_length=32)
    ttft_hist = models.JSONField(default=dict, blank=True)
    tpot_hist = models.JSONField(default=dict, blank=True)
    latency_hist = models.JSONField(default=dict, blank=True)

    class Meta:
        verbose_name = "hourly latency"
        verbose_name_plural = "hourly latency"
        ordering = ["-hour"]
        constraints = [models.UniqueConstraint(fields=["hour", "model", "source"], name="latency_hourly_unique")]

    def __str__(self) -> str:
        return f"{self.hour:%Y-%m-%d %H}:00 {self.model}/{self.source}"


class RollupState(models.Model):
    """Roll-up watermark: every hour before rolled_until is in UsageHourly; later usage is read live."""

    name = models.CharField(max_length=64, unique=True, default="usage")
    rolled_until = models.DateTimeField(null=True, blank=True)
    updated_at = models.DateTimeField(auto_now=True)

    def __str__(self) -> str:
        return f"{self.name} rolled until {self.rolled_until}"
