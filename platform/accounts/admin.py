from django.contrib import admin, messages
from django.contrib.auth import get_user_model
from django.contrib.auth.admin import UserAdmin

from .forms import ThrottledAdminLoginForm
from .models import ApiKey

# /admin/login/ counts failures and locks out exactly like the site's log-in page (accounts/throttle.py).
admin.site.login_form = ThrottledAdminLoginForm


@admin.register(ApiKey)
class ApiKeyAdmin(admin.ModelAdmin):
    list_display = ("prefix", "name", "user", "created_at", "last_used_at", "expires_at", "revoked_at")
    list_filter = ("revoked_at",)
    search_fields = ("prefix", "name", "user__username")
    readonly_fields = ("prefix", "hashed_key", "created_at", "last_used_at")
    raw_id_fields = ("user",)


@admin.action(description="Approve the selected accounts (SIGNUP_REQUIRES_APPROVAL)")
def approve_accounts(modeladmin, request, queryset):
    approved = queryset.filter(is_active=False).update(is_active=True)
    modeladmin.message_user(request, f"{approved} account(s) approved.", messages.SUCCESS)


class TesseraUserAdmin(UserAdmin):
    actions = [approve_accounts]


admin.site.unregister(get_user_model())
admin.site.register(get_user_model(), TesseraUserAdmin)
