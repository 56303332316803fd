from django.urls import path

from .consumers import BatchProgressConsumer

websocket_urlpatterns = [
    path("ws/batches/<str:batch_id>/", BatchProgressConsumer.as_asgi()),
]
