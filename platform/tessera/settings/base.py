"""Settings shared by every environment. Everything deployment-specific comes from the env."""

import os
from pathlib import Path

import dj_database_url

from common.redis_async import pool_kwargs
from tessera.exposure import DEV_SECRET_KEY

REPO_DIR = Path(__file__).resolve().parents[3]
PLATFORM_DIR = REPO_DIR / "platform"
VAR_DIR = Path(os.environ.get("TESSERA_VAR_DIR", REPO_DIR / "var"))

SECRET_KEY = os.environ.get("SECRET_KEY", DEV_SECRET_KEY)
DEBUG = os.environ.get("DEBUG", "0") == "1"
ALLOWED_HOSTS = [h for h in os.environ.get("ALLOWED_HOSTS", "127.0.0.1,localhost").split(",") if h]
CSRF_TRUSTED_ORIGINS = [o for o in os.environ.get("CSRF_TRUSTED_ORIGINS", "").split(",") if o]

INSTALLED_APPS = [
    "daphne",
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "rest_framework",
    "drf_spectacular",
    "channels",
    "accounts",
    "quotas",
    "usage",
    "engine_client",
    "openai_api",
    "chat",
    "batches",
    "dashboard",
]

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "whitenoise.middleware.WhiteNoiseMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
    "openai_api.middleware.OpenAIErrorMiddleware",
]
# /v1/..., /health and /metrics run through this list alone (tessera/asgi.py APIHandler): async-only,
# so an API request reaches its view without thread hops.
API_MIDDLEWARE = ["openai_api.middleware.OpenAIErrorMiddleware"]

ROOT_URLCONF = "tessera.urls"
ASGI_APPLICATION = "tessera.asgi.application"
WSGI_APPLICATION = "tessera.wsgi.application"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [REPO_DIR / "templates"],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
                "accounts.context_processors.signup",
            ]
        },
    }
]


def databases(database_url: str | None) -> dict:
    """DATABASES for DATABASE_URL (PostgreSQL in production and `make test`), else SQLite in var/."""
    # Health checks: a persistent connection that died with its server (a PostgreSQL restart) is
    # replaced at the start of the next request instead of failing it.
    default = dj_database_url.parse(
        database_url or f"sqlite:///{VAR_DIR / 'db.sqlite3'}", conn_max_age=600, conn_health_checks=True
    )
    if default["ENGINE"] == "django.db.backends.sqlite3":
        # WAL: readers (dashboard, history) never block the writer that records usage per request, and
        # with WAL, synchronous=NORMAL is still crash-safe while a commit skips its fsync.
        default.setdefault("OPTIONS", {}).setdefault(
            "init_command", "PRAGMA journal_mode=WAL; PRAGMA synchronous=NORMAL;"
        )
        # IMMEDIATE: a transaction that reads before it writes (finish_reply) takes the write lock at
        # BEGIN and waits its turn; a deferred one failed at once with "database is locked" when another
        # thread committed between its read and its write (the playground reply left "streaming").
        default["OPTIONS"].setdefault("transaction_mode", "IMMEDIATE")
    return {"default": default}


DATABASES = databases(os.environ.get("DATABASE_URL"))

AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.UserAttributeSimilarityValidator"},
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator"},
    {"NAME": "django.contrib.auth.password_validation.CommonPasswordValidator"},
]
LOGIN_URL = "accounts:login"
LOGIN_REDIRECT_URL = "/"
LOGOUT_REDIRECT_URL = "/"

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = True
USE_TZ = True

STATIC_URL = "static/"
STATIC_ROOT = VAR_DIR / "static"
STATICFILES_DIRS = [d for d in [REPO_DIR / "platform" / "static", VAR_DIR / "assets"] if d.exists()]
MEDIA_ROOT = VAR_DIR / "media"
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

# Redis carries the engine protocol, the channel layer, quotas and the Celery broker.
REDIS_URL = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")


def channel_layers(redis_url: str) -> dict:
    """The layer waits up to 5 s in BZPOPMIN, and redis-py >= 8 also gives up on a socket read after
    5 s by default: a reply a little late (a busy machine) crashed the websocket consumer, so its
    reads get a longer timeout. Its connections are redis_async's, so a consumer's cancellation is
    never lost (Python 3.11's wait_for can drop one)."""
    return {
        "default": {
            "BACKEND": "channels_redis.core.RedisChannelLayer",
            "CONFIG": {"hosts": [pool_kwargs(redis_url, socket_timeout=30)]},
        }
    }


CHANNEL_LAYERS = channel_layers(REDIS_URL)

CELERY_BROKER_URL = REDIS_URL
CELERY_RESULT_BACKEND = None
CELERY_TASK_ACKS_LATE = True
CELERY_TASK_REJECT_ON_WORKER_LOST = True
CELERY_WORKER_PREFETCH_MULTIPLIER = 1
CELERY_TASK_TIME_LIMIT = 6 * 3600
CELERY_TASK_SOFT_TIME_LIMIT = 6 * 3600 - 60
CELERY_BROKER_TRANSPORT_OPTIONS = {"visibility_timeout": 3600}
# Periodic tasks (celery beat); each app adds its own entry.
CELERY_BEAT_SCHEDULE = {
    "dashboard-roll-up-usage": {"task": "dashboard.roll_up_usage", "schedule": 300.0},
    # Expires overdue batches and restarts batches whose runner died (see batches/tasks.py).
    "batches-watchdog": {"task": "batches.watchdog", "schedule": float(os.environ.get("BATCH_WATCHDOG_INTERVAL", 15))},
    "batches-delete-expired-files": {"task": "batches.delete_expired_files", "schedule": 3600.0},
    "chat-finish-stale-replies": {"task": "chat.finish_stale_replies", "schedule": 300.0},
}

REST_FRAMEWORK = {
    "DEFAULT_SCHEMA_CLASS": "drf_spectacular.openapi.AutoSchema",
    "UNAUTHENTICATED_USER": None,
    "EXCEPTION_HANDLER": "openai_api.errors.drf_exception_handler",
}
SPECTACULAR_SETTINGS = {
    "TITLE": "Tessera API",
    "DESCRIPTION": "OpenAI-compatible inference API served by Tessera",
    "VERSION": "0.1.0",
}

# The model the engine workers serve (a HF folder or a .gguf file; unset: the bundled SmolLM2);
# the web tier only needs its name and tokenizer. inference.gguf_files imports no torch.
from inference.gguf_files import resolve_model, served_model_name  # noqa: E402

MODEL = resolve_model(os.environ.get("MODEL"))
SERVED_MODEL_NAME = os.environ.get("SERVED_MODEL_NAME") or served_model_name(MODEL)
# The tool-call format to read answers in (vLLM's --tool-call-parser): hermes, llama3_json or mistral;
# empty: chosen per model from its tokenizer (openai_api/tool_calls/parsers.py choose_parser).
TOOL_CALL_PARSER = os.environ.get("TOOL_CALL_PARSER", "")

# Quotas: the plan of users without one assigned in admin (None = unlimited, [] = every model).
QUOTA_DEFAULT_PLAN = {
    "name": "default",
    "tokens_per_day": int(os.environ.get("QUOTA_TOKENS_PER_DAY", 200_000)),
    "tokens_per_month": int(os.environ.get("QUOTA_TOKENS_PER_MONTH", 2_000_000)),
    "requests_per_minute": int(os.environ.get("QUOTA_REQUESTS_PER_MINUTE", 60)),
    # 16, not 4: the engine's fair share (scheduling_policy fair) keeps one user from crowding out others,
    # so the quota only bounds what one user may hold (docs/architecture.md, Fair share).
    "concurrent_requests": int(os.environ.get("QUOTA_CONCURRENT_REQUESTS", 16)),
    "max_tokens_per_request": int(os.environ.get("QUOTA_MAX_TOKENS_PER_REQUEST", 2048)),
    "allowed_models": [],
}
QUOTA_LEASE_SECONDS = 120  # a vanished client's concurrency slot frees itself after this
# Log-in limits (accounts/throttle.py): a hard lock per (username, address); past the wider two,
# only addresses that never logged in to that account are refused, so nobody can lock out others.
LOGIN_ATTEMPTS_PER_15_MIN = 10  # failures per (username, client address)
LOGIN_FAILURES_PER_USERNAME = 50  # failures per username from any address
LOGIN_FAILURES_PER_ADDRESS = 100  # failures per client address over any usernames
# Sign-up: open (ALLOW_SIGNUP), throttled per address, and optionally held for an admin's approval.
ALLOW_SIGNUP = os.environ.get("ALLOW_SIGNUP", "1") == "1"
SIGNUP_REQUIRES_APPROVAL = os.environ.get("SIGNUP_REQUIRES_APPROVAL", "0") == "1"
SIGNUPS_PER_HOUR_PER_ADDRESS = int(os.environ.get("SIGNUPS_PER_HOUR_PER_ADDRESS", 5))
CHAT_RECONNECT_GRACE_S = 20  # a playground answer nobody watches for this long is aborted in the engine

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "handlers": {"console": {"class": "logging.StreamHandler"}},
    "root": {"handlers": ["console"], "level": os.environ.get("LOG_LEVEL", "INFO")},
}
