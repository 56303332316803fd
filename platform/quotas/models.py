"""Plans (limits) and the per-user override; live counters live in Redis, not here."""

import math

from django.conf import settings
from django.core.exceptions import ValidationError
from django.db import models


def validate_share(value) -> None:
    """A plan's fair share weight must be a positive, finite number (the engine divides service by it)."""
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) or value <= 0:
        raise ValidationError("share must be a positive number", code="invalid_share")


class Plan(models.Model):
    """A set of limits. A blank limit means unlimited; an empty allowed_models means every model."""

    name = models.CharField(max_length=64, unique=True)
    tokens_per_day = models.PositiveBigIntegerField(null=True, blank=True)
    tokens_per_month = models.PositiveBigIntegerField(null=True, blank=True)
    requests_per_minute = models.PositiveIntegerField(null=True, blank=True)
    concurrent_requests = models.PositiveIntegerField(null=True, blank=True)
    max_tokens_per_request = models.PositiveIntegerField(null=True, blank=True)
    allowed_models = models.JSONField(default=list, blank=True)
    # the weight of its users' fair share in the engine (scheduling_policy=fair): 2 gets twice the service of 1
    share = models.FloatField(default=1.0, validators=[validate_share])

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name


class UserPlan(models.Model):
    """Assigns a plan to one user; users without one get settings.QUOTA_DEFAULT_PLAN."""

    user = models.OneToOneField(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="quota_plan")
    plan = models.ForeignKey(Plan, on_delete=models.PROTECT, related_name="user_plans")

    def __str__(self) -> str:
        return f"{self.user} -> {self.plan}"
