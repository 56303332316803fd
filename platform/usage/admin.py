from django.contrib import admin

from .models import UsageRecord


@admin.register(UsageRecord)
class UsageRecordAdmin(admin.ModelAdmin):
    list_display = (
        "created_at",
        "user",
        "source",
        "endpoint",
        "model",
        "prompt_tokens",
        "completion_tokens",
        "cached_tokens",
        "ttft_ms",
        "latency_ms",
        "status_code",
        "error_code",
    )
    list_filter = ("source", "endpoint", "status_code", "model")
    search_fields = ("request_id", "user__username")
    date_hierarchy = "created_at"
    raw_id_fields = ("user", "api_key")
