"""Responses the Responses API stored (`store`, OpenAI's default): retrieval, delete and previous_response_id.

A row keeps the response object as the client saw it and the conversation that led to it, in
Responses input items, so a follow-up with previous_response_id needs this one row, not a walk
back through the chain. Rows are per user: another user's id is a 404, never a 403.
"""

import secrets

from django.conf import settings
from django.db import models


def new_response_id() -> str:
    """OpenAI's shape: "resp_" and hex."""
    return f"resp_{secrets.token_hex(24)}"


class StoredResponse(models.Model):
    public_id = models.CharField(max_length=64, unique=True, editable=False)
    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="stored_responses")
    model = models.CharField(max_length=200)
    body = models.JSONField(help_text="the response object, as returned")
    conversation = models.JSONField(help_text="the input items before this response's output (instructions aside)")
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["-id"]
        indexes = [models.Index(fields=["user", "-id"])]

    def __str__(self) -> str:
        return self.public_id
