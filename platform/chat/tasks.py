"""Periodic clean-up (Celery beat: settings.CELERY_BEAT_SCHEDULE["chat-finish-stale-replies"])."""

from celery import shared_task

from . import services


@shared_task(name="chat.finish_stale_replies")
def finish_stale_replies() -> int:
    """Idempotent: only replies still "streaming" long after their last save are touched."""
    return services.finish_stale_replies()
