"""pytest settings: fast hashing, a throwaway database, a private real Redis for the session."""

from tessera import embedded_postgres, embedded_redis

from .base import *  # noqa: F401,F403

DEBUG = False
PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]
SECRET_KEY = "test-secret-key"
ALLOWED_HOSTS = ["*"]

REDIS_URL = embedded_redis.ensure_test_redis()
CHANNEL_LAYERS = channel_layers(REDIS_URL)  # noqa: F405
CELERY_BROKER_URL = REDIS_URL

# TESSERA_DB=postgres (`make test`): a throwaway PostgreSQL server for the session, as for Redis;
# pytest-django creates its test database on it. Unset: SQLite.
DATABASES = databases(embedded_postgres.ensure_test_database())  # noqa: F405
