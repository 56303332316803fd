from django.contrib import admin

from .models import Conversation, Message


class MessageInline(admin.TabularInline):
    model = Message
    fields = ["role", "status", "content", "parent", "completion_tokens", "created_at"]
    readonly_fields = fields
    extra = 0
    can_delete = False
    show_change_link = True


@admin.register(Conversation)
class ConversationAdmin(admin.ModelAdmin):
    list_display = ["title", "user", "model", "updated_at"]
    list_select_related = ["user"]
    search_fields = ["title", "user__username"]
    raw_id_fields = ["user", "current_leaf"]
    inlines = [MessageInline]


@admin.register(Message)
class MessageAdmin(admin.ModelAdmin):
    list_display = ["id", "conversation", "role", "status", "completion_tokens", "created_at"]
    list_filter = ["role", "status"]
    raw_id_fields = ["conversation", "parent"]
    search_fields = ["content", "request_id"]
