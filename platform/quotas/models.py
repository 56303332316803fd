"""Plans (limits) and the per-user override; live counters live in Redis, not here."""
from django.conf import settings
from django.db import models


class Plan(models.Model):
    """A set of limits. A blank limit means unlimited; an empty allowed_models means every model."""

    name = models.CharField(max_length=64, unique=True)
    tokens_per_day = models.PositiveBigIntegerField(null=True, blank=True)
    tokens_per_month = models.PositiveBigIntegerField(null=True, blank=True)
    requests_per_minute = models.PositiveIntegerField(null=True, blank=True)
    concurrent_requests = models.PositiveIntegerField(null=True, blank=True)
    max_tokens_per_request = models.PositiveIntegerField(null=True, blank=True)
    allowed_models = models.JSONField(default=list, blank=True)

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
