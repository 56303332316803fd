from django.urls import path

from .consumers import EngineLiveConsumer

websocket_urlpatterns = [
    path("ws/dashboard/engine/", EngineLiveConsumer.as_asgi()),
]
