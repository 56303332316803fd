from django.urls import path
from drf_spectacular.views import SpectacularJSONAPIView

from . import views

urlpatterns = [
    path("v1/chat/completions", views.ChatCompletionsView.as_view(), name="v1-chat-completions"),
    path("v1/completions", views.CompletionsView.as_view(), name="v1-completions"),
    path("v1/models", views.ModelListView.as_view(), name="v1-models"),
    path("v1/models/<path:model>", views.ModelDetailView.as_view(), name="v1-model"),
    path("v1/openapi.json", SpectacularJSONAPIView.as_view(), name="v1-openapi"),
    path("health", views.HealthView.as_view(), name="health"),
    path("metrics", views.MetricsView.as_view(), name="metrics"),
]
