from django.apps import AppConfig


class EngineClientConfig(AppConfig):
    default_auto_field = "django.db.models.BigAutoField"
    name = "engine_client"
