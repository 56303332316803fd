"""/v1/files, /v1/batches (OpenAI's API) and the Batches web pages; included at the site root."""

from django.urls import path

from . import api, views

app_name = "batches"

urlpatterns = [
    path("v1/files", api.FilesView.as_view(), name="api_files"),
    path("v1/files/<str:file_id>", api.FileView.as_view(), name="api_file"),
    path("v1/files/<str:file_id>/content", api.FileContentView.as_view(), name="api_file_content"),
    path("v1/batches", api.BatchesView.as_view(), name="api_batches"),
    path("v1/batches/<str:batch_id>", api.BatchView.as_view(), name="api_batch"),
    path("v1/batches/<str:batch_id>/cancel", api.BatchCancelView.as_view(), name="api_batch_cancel"),
    path("batches/", views.batch_list, name="list"),
    path("batches/upload/", views.upload, name="upload"),
    path("batches/<str:batch_id>/", views.batch_detail, name="detail"),
    path("batches/<str:batch_id>/cancel/", views.cancel, name="cancel"),
    path("batches/files/<str:file_id>/download/", views.download, name="download"),
]
