from django.urls import path

from . import views

app_name = "history"

urlpatterns = [
    path("", views.conversation_list, name="conversations"),
    path("c/<uuid:conversation_id>/rename/", views.conversation_rename, name="rename"),
    path("c/<uuid:conversation_id>/delete/", views.conversation_delete, name="delete"),
    path("c/<uuid:conversation_id>/export.json", views.conversation_export_json, name="export_json"),
    path("c/<uuid:conversation_id>/export.md", views.conversation_export_markdown, name="export_markdown"),
    path("requests/", views.request_list, name="requests"),
    path("requests/<int:record_id>/", views.request_detail, name="request_detail"),
    path("usage/", views.usage, name="usage"),
]
