"""DRF authentication by `Authorization: Bearer <api key>` (for DRF views under /v1)."""

from drf_spectacular.extensions import OpenApiAuthenticationExtension
from rest_framework import authentication, exceptions

from .services import authenticate_api_key


def bearer_token(header: str | None) -> str | None:
    if not header:
        return None
    scheme, _, token = header.partition(" ")
    return token.strip() or None if scheme.lower() == "bearer" else None


class ApiKeyAuthentication(authentication.BaseAuthentication):
    def authenticate(self, request):
        raw = bearer_token(request.META.get("HTTP_AUTHORIZATION"))
        if raw is None:
            return None
        key = authenticate_api_key(raw)
        if key is None:
            raise exceptions.AuthenticationFailed("Incorrect API key provided.", code="invalid_api_key")
        return key.user, key

    def authenticate_header(self, request):
        return "Bearer"


class ApiKeyAuthenticationScheme(OpenApiAuthenticationExtension):
    target_class = "accounts.authentication.ApiKeyAuthentication"
    name = "ApiKeyAuth"

    def get_security_definition(self, auto_schema):
        return {"type": "http", "scheme": "bearer", "description": "A Tessera API key (tsk-...)"}
