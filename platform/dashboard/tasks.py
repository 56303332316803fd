"""Periodic roll-up (Celery beat: settings.CELERY_BEAT_SCHEDULE["dashboard-roll-up-usage"])."""

from celery import shared_task

from . import services


@shared_task(name="dashboard.roll_up_usage", ignore_result=True)
def roll_up_usage() -> dict:
    # Idempotent and takes no ids: it rebuilds whole hours up to now, so a retry or overlap is harmless.
    return services.roll_up_usage()
