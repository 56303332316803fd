"""One row per generation request from any entry point (playground, /v1 API, batch lines).

Two TTFTs, each with one definition for every entry point: ttft_ms runs from the request's
arrival at Tessera (the HTTP request, the websocket frame, the batch line's submission) to its
first token, as its client sees it (the dashboard charts this one); engine_ttft_ms runs from the
engine worker's acceptance of the request to its first token (docs/protocol.md, finish metrics).
"""

from django.conf import settings
from django.db import models


class UsageRecord(models.Model):
    class Source(models.TextChoices):
        PLAYGROUND = "playground"
        API = "api"
        BATCH = "batch"

    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="usage_records")
    api_key = models.ForeignKey(
        "accounts.ApiKey", null=True, blank=True, on_delete=models.SET_NULL, related_name="usage_records"
    )
    source = models.CharField(max_length=16, choices=Source.choices)
    endpoint = models.CharField(max_length=64, blank=True)
    model = models.CharField(max_length=200, blank=True)
    request_id = models.CharField(max_length=64, blank=True, db_index=True)
    prompt_tokens = models.PositiveIntegerField(default=0)
    completion_tokens = models.PositiveIntegerField(default=0)
    cached_tokens = models.PositiveIntegerField(default=0)
    ttft_ms = models.FloatField(null=True, blank=True, help_text="time to first token from the request's arrival (ms)")
    engine_ttft_ms = models.FloatField(
        null=True, blank=True, help_text="time to first token from the engine worker's acceptance (ms)"
    )
    latency_ms = models.FloatField(null=True, blank=True)
    status_code = models.PositiveSmallIntegerField(default=200)
    error_code = models.CharField(max_length=64, blank=True)
    end_user = models.CharField(max_length=256, blank=True, help_text="the request's OpenAI `user` field")
    created_at = models.DateTimeField(auto_now_add=True, db_index=True)

    class Meta:
        ordering = ["-created_at"]
        indexes = [models.Index(fields=["user", "-created_at"])]

    def __str__(self) -> str:
        return f"{self.source} {self.endpoint} {self.request_id} ({self.status_code})"

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens
