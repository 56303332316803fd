"""Websocket routes of every app (each app adds its own list here)."""

websocket_urlpatterns = []

from dashboard.routing import websocket_urlpatterns as dashboard_ws  # noqa: E402

websocket_urlpatterns += dashboard_ws

from chat.routing import websocket_urlpatterns as chat_ws  # noqa: E402

websocket_urlpatterns += chat_ws

from batches.routing import websocket_urlpatterns as batches_ws  # noqa: E402

websocket_urlpatterns += batches_ws
