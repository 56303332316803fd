"""ASGI entry point: HTTP through Django, websockets through Channels."""

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tessera.settings.dev")

from django.conf import settings  # noqa: E402
from django.core.asgi import get_asgi_application  # noqa: E402
from django.core.exceptions import RequestAborted  # noqa: E402
from django.core.handlers.asgi import ASGIHandler  # noqa: E402

django_asgi_app = get_asgi_application()

from common import http_guards  # noqa: E402
from openai_api.middleware import status_envelope  # noqa: E402  (needs the apps loaded)


class APIHandler(ASGIHandler):
    """Django for the machine-facing paths (/v1/..., /health, /metrics) with settings.API_MIDDLEWARE.

    In async mode every MiddlewareMixin middleware hops to the sync thread and back twice per
    request, and WhiteNoise is sync-only; the API's views are async, authenticate by API key and
    need none of the browser middleware (sessions, CSRF, messages), whose cost before the view ran
    is measured in docs/architecture.md.
    """

    def load_middleware(self, is_async=False):
        # Django reads settings.MIDDLEWARE here and only here (once, at start-up, before any request).
        browser_middleware = settings.MIDDLEWARE
        settings.MIDDLEWARE = settings.API_MIDDLEWARE
        try:
            super().load_middleware(is_async)
        finally:
            settings.MIDDLEWARE = browser_middleware

    async def __call__(self, scope, receive, send):
        # Django wraps each request in a ThreadSensitiveContext, which starts a thread of its own for
        # the request's thread-sensitive sync code: here only the request_started/finished receivers
        # (the API's views run sync code on the bookkeeping thread). asgiref's one sync thread serves
        # them instead: less time per request, and no thread start on a busy machine. (http_app
        # sends it HTTP only.)
        await self.handle(scope, receive, send)

    async def handle(self, scope, receive, send):
        await super().handle(scope, http_guards.capped_receive(scope, receive), send)

    async def listen_for_disconnect(self, receive):
        """Django's, but a disconnect ends it quietly. handle() waits for this task or the response's, whichever
        ends first, as before; a RequestAborted raised here and re-raised in handle() held handle()'s frame in
        its traceback, whose tasks held the exception: every streamed request (uvicorn reports the disconnect
        once a response is complete) left its objects in a cycle only the collector frees, in pauses that grew
        with the streams open (a 0.5 s one under a flood; docs/benchmarks.md, Fair share)."""
        try:
            await super().listen_for_disconnect(receive)
        except RequestAborted:
            pass

    def create_request(self, scope, body_file):
        """413 for a body over the limit; Django's bare 400 for bytes that are not UTF-8, as the envelope."""
        if scope.get(http_guards.BODY_TOO_LARGE):
            return None, status_envelope(413, scope["method"], scope["path"])
        request, refused = super().create_request(scope, body_file)
        if refused is not None:
            refused = status_envelope(refused.status_code, scope["method"], scope["path"])
        return request, refused


api_asgi_app = APIHandler()


async def http_app(scope, receive, send):
    await (api_asgi_app if http_guards.is_machine_path(scope["path"]) else django_asgi_app)(scope, receive, send)


from channels.auth import AuthMiddlewareStack  # noqa: E402
from channels.routing import ProtocolTypeRouter, URLRouter  # noqa: E402
from channels.security.websocket import AllowedHostsOriginValidator  # noqa: E402

from tessera.routing import websocket_urlpatterns  # noqa: E402

application = ProtocolTypeRouter(
    {
        "http": http_app,
        "websocket": AllowedHostsOriginValidator(AuthMiddlewareStack(URLRouter(websocket_urlpatterns))),
    }
)
