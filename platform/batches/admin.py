from django.contrib import admin

from .models import Batch, BatchLine, File


@admin.register(File)
class FileAdmin(admin.ModelAdmin):
    list_display = ("public_id", "user", "purpose", "filename", "bytes", "created_at", "expires_at")
    list_filter = ("purpose",)
    search_fields = ("public_id", "filename", "user__username")
    exclude = ("content",)


@admin.register(Batch)
class BatchAdmin(admin.ModelAdmin):
    list_display = ("public_id", "user", "endpoint", "status", "total", "completed", "failed", "created_at")
    list_filter = ("status", "endpoint")
    search_fields = ("public_id", "user__username")
    raw_id_fields = ("input_file", "output_file", "error_file")


@admin.register(BatchLine)
class BatchLineAdmin(admin.ModelAdmin):
    list_display = ("batch", "line_number", "custom_id", "status", "attempts")
    list_filter = ("status",)
    search_fields = ("custom_id", "batch__public_id")
    raw_id_fields = ("batch",)
