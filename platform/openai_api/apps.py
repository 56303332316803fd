from django.apps import AppConfig


class OpenaiApiConfig(AppConfig):
    default_auto_field = "django.db.models.BigAutoField"
    name = "openai_api"

    def ready(self):
        from . import credentials

        credentials.connect_signals()  # a changed key, user or plan empties every process's credential cache
