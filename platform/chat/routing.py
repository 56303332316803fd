from django.urls import path

from .consumers import PlaygroundConsumer

websocket_urlpatterns = [
    path("ws/chat/", PlaygroundConsumer.as_asgi()),
]
