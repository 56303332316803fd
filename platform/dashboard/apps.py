from django.apps import AppConfig


class DashboardConfig(AppConfig):
    default_auto_field = "django.db.models.BigAutoField"
    name = "dashboard"

    def ready(self):
        # GET /metrics (openai_api) renders every collector on its extension list.
        from openai_api import metrics as prometheus

        from . import metrics

        if metrics.collect not in prometheus.EXTRA_COLLECTORS:
            prometheus.EXTRA_COLLECTORS.append(metrics.collect)
