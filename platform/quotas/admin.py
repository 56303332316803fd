from django.contrib import admin

from .models import Plan, UserPlan


@admin.register(Plan)
class PlanAdmin(admin.ModelAdmin):
    list_display = [
        "name",
        "tokens_per_day",
        "tokens_per_month",
        "requests_per_minute",
        "concurrent_requests",
        "max_tokens_per_request",
        "share",
    ]
    search_fields = ["name"]


@admin.register(UserPlan)
class UserPlanAdmin(admin.ModelAdmin):
    list_display = ["user", "plan"]
    list_select_related = ["user", "plan"]
    autocomplete_fields = ["plan"]
    raw_id_fields = ["user"]
    search_fields = ["user__username", "plan__name"]
