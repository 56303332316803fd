"""Production (compose.yaml): DEBUG off, SECRET_KEY required, sign-up closed unless ALLOW_SIGNUP=1."""

import os

from django.core.exceptions import ImproperlyConfigured

from tessera.exposure import DEV_SECRET_KEY

from .base import *  # noqa: F401,F403

DEBUG = False  # whatever DEBUG says: a traceback page shows settings and environment to anyone
SECRET_KEY = os.environ.get("SECRET_KEY", "")
if not SECRET_KEY or SECRET_KEY == DEV_SECRET_KEY:
    raise ImproperlyConfigured(
        "tessera.settings.prod needs SECRET_KEY in the environment (a long random string, e.g. "
        "`openssl rand -hex 32`); it signs sessions and CSRF tokens, so the public default is refused."
    )
ALLOW_SIGNUP = os.environ.get("ALLOW_SIGNUP", "0") == "1"
SESSION_COOKIE_SECURE = os.environ.get("SECURE_COOKIES", "1") == "1"
CSRF_COOKIE_SECURE = SESSION_COOKIE_SECURE
STORAGES = {
    "default": {"BACKEND": "django.core.files.storage.FileSystemStorage"},
    "staticfiles": {"BACKEND": "whitenoise.storage.CompressedManifestStaticFilesStorage"},
}
