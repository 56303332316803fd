from django.urls import path
from drf_spectacular.views import SpectacularJSONAPIView

from . import embeddings_views, responses_views, views

urlpatterns = [
    path("v1/chat/completions", views.ChatCompletionsView.as_view(), name="v1-chat-completions"),
    path("v1/completions", views.CompletionsView.as_view(), name="v1-completions"),
    path("v1/embeddings", embeddings_views.EmbeddingsView.as_view(), name="v1-embeddings"),
    path("v1/responses", responses_views.ResponsesView.as_view(), name="v1-responses"),
    path("v1/responses/<str:response_id>", responses_views.ResponseDetailView.as_view(), name="v1-response"),
    path(
        "v1/responses/<str:response_id>/input_items",
        responses_views.ResponseInputItemsView.as_view(),
        name="v1-response-input-items",
    ),
    path("v1/models", views.ModelListView.as_view(), name="v1-models"),
    path("v1/models/<path:model>", views.ModelDetailView.as_view(), name="v1-model"),
    path("v1/openapi.json", SpectacularJSONAPIView.as_view(), name="v1-openapi"),
    # vLLM serves its tokenizer routes at the root, not under /v1 (lm-eval probes them there)
    path("tokenize", views.TokenizeView.as_view(), name="tokenize"),
    path("detokenize", views.DetokenizeView.as_view(), name="detokenize"),
    path("tokenizer_info", views.TokenizerInfoView.as_view(), name="tokenizer-info"),
    path("health", views.HealthView.as_view(), name="health"),
    path("metrics", views.MetricsView.as_view(), name="metrics"),
]
