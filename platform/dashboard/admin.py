from django.contrib import admin

from .models import LatencyHourly, RollupState, UsageHourly


@admin.register(UsageHourly)
class UsageHourlyAdmin(admin.ModelAdmin):
    list_display = (
        "hour",
        "user",
        "api_key_id",
        "model",
        "source",
        "requests",
        "prompt_tokens",
        "completion_tokens",
        "errors",
        "rate_limited",
    )
    list_filter = ("source", "model")
    search_fields = ("user__username", "model")
    date_hierarchy = "hour"
    list_select_related = ("user",)
    raw_id_fields = ("user",)
    # Roll-ups are rebuilt from usage records; editing one by hand would be undone by the next run.
    readonly_fields = [f.name for f in UsageHourly._meta.fields]

    def has_add_permission(self, request):
        return False


@admin.register(LatencyHourly)
class LatencyHourlyAdmin(admin.ModelAdmin):
    list_display = ("hour", "model", "source")
    list_filter = ("source", "model")
    date_hierarchy = "hour"
    readonly_fields = [f.name for f in LatencyHourly._meta.fields]

    def has_add_permission(self, request):
        return False


@admin.register(RollupState)
class RollupStateAdmin(admin.ModelAdmin):
    list_display = ("name", "rolled_until", "updated_at")
    readonly_fields = ("name", "rolled_until", "updated_at")
