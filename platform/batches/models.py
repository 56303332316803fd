"""Files (uploaded JSONL and generated results), batches, and one row per input line.

A BatchLine is the unit of exactly-once: (batch, custom_id) is unique and a line's result is
written by a conditional update that only succeeds while the line is still unfinished, so a
redelivered or restarted runner can never record a line twice.
File contents live in the database (not on a local disk) so the web tier and the Celery
workers share them in every deployment without a shared volume.
"""

import secrets

from django.conf import settings
from django.db import models


def new_file_id() -> str:
    return f"file-{secrets.token_hex(12)}"


def new_batch_id() -> str:
    return f"batch_{secrets.token_hex(12)}"


class File(models.Model):
    class Purpose(models.TextChoices):
        BATCH = "batch"
        BATCH_OUTPUT = "batch_output"

    public_id = models.CharField(max_length=40, unique=True, default=new_file_id, editable=False)
    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="batch_files")
    purpose = models.CharField(max_length=32, choices=Purpose.choices)
    filename = models.CharField(max_length=255)
    bytes = models.PositiveBigIntegerField()
    content = models.BinaryField()
    created_at = models.DateTimeField(auto_now_add=True)
    expires_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-id"]
        indexes = [models.Index(fields=["user", "-id"]), models.Index(fields=["expires_at"])]

    def __str__(self) -> str:
        return f"{self.public_id} ({self.filename})"


class Batch(models.Model):
    class Status(models.TextChoices):
        VALIDATING = "validating"
        FAILED = "failed"
        IN_PROGRESS = "in_progress"
        FINALIZING = "finalizing"
        COMPLETED = "completed"
        EXPIRED = "expired"
        CANCELLING = "cancelling"
        CANCELLED = "cancelled"

    TERMINAL = (Status.FAILED, Status.COMPLETED, Status.EXPIRED, Status.CANCELLED)

    public_id = models.CharField(max_length=40, unique=True, default=new_batch_id, editable=False)
    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="batches")
    input_file = models.ForeignKey(File, null=True, blank=True, on_delete=models.SET_NULL, related_name="+")
    input_file_public_id = models.CharField(max_length=40)
    endpoint = models.CharField(max_length=64)
    completion_window = models.CharField(max_length=8, default="24h")
    status = models.CharField(max_length=16, choices=Status.choices, default=Status.VALIDATING)
    # Validation errors: [{"code", "message", "param", "line"}].
    errors = models.JSONField(default=list, blank=True)
    metadata = models.JSONField(null=True, blank=True)
    output_file = models.ForeignKey(File, null=True, blank=True, on_delete=models.SET_NULL, related_name="+")
    error_file = models.ForeignKey(File, null=True, blank=True, on_delete=models.SET_NULL, related_name="+")

    total = models.PositiveIntegerField(default=0)
    completed = models.PositiveIntegerField(default=0)
    failed = models.PositiveIntegerField(default=0)
    input_tokens = models.PositiveBigIntegerField(default=0)
    cached_tokens = models.PositiveBigIntegerField(default=0)
    output_tokens = models.PositiveBigIntegerField(default=0)

    # Why the batch is waiting while still in_progress (e.g. the daily token budget is spent).
    paused_reason = models.CharField(max_length=255, blank=True, default="")
    # Runner lease: one runner at a time; a runner that dies stops renewing and another takes over.
    lease_owner = models.CharField(max_length=64, blank=True, default="")
    lease_until = models.DateTimeField(null=True, blank=True)
    # A paused batch is not resumed by the watchdog before this time.
    resume_after = models.DateTimeField(null=True, blank=True)

    created_at = models.DateTimeField(auto_now_add=True)
    in_progress_at = models.DateTimeField(null=True, blank=True)
    expires_at = models.DateTimeField()
    finalizing_at = models.DateTimeField(null=True, blank=True)
    completed_at = models.DateTimeField(null=True, blank=True)
    failed_at = models.DateTimeField(null=True, blank=True)
    expired_at = models.DateTimeField(null=True, blank=True)
    cancelling_at = models.DateTimeField(null=True, blank=True)
    cancelled_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-id"]
        indexes = [models.Index(fields=["user", "-id"]), models.Index(fields=["status", "expires_at"])]

    def __str__(self) -> str:
        return f"{self.public_id} ({self.status})"

    @property
    def is_terminal(self) -> bool:
        return self.status in self.TERMINAL


class BatchLine(models.Model):
    class Status(models.TextChoices):
        PENDING = "pending"
        RUNNING = "running"
        COMPLETED = "completed"
        FAILED = "failed"
        CANCELLED = "cancelled"
        EXPIRED = "expired"

    UNFINISHED = (Status.PENDING, Status.RUNNING)

    batch = models.ForeignKey(Batch, on_delete=models.CASCADE, related_name="lines")
    line_number = models.PositiveIntegerField()
    custom_id = models.CharField(max_length=512)
    method = models.CharField(max_length=8, default="POST")
    url = models.CharField(max_length=64)
    body = models.JSONField()
    status = models.CharField(max_length=16, choices=Status.choices, default=Status.PENDING)
    attempts = models.PositiveIntegerField(default=0)
    # The engine request id of the latest attempt (aborted if a new runner takes the line over).
    engine_request_id = models.CharField(max_length=96, blank=True, default="")
    # The quota reservation of the running attempt (quotas.ledger.Reservation.as_dict()), so a
    # runner that takes over after a crash can settle what the dead one reserved.
    reservation = models.JSONField(null=True, blank=True)
    result_id = models.CharField(max_length=40, blank=True, default="")
    response_status = models.PositiveSmallIntegerField(null=True, blank=True)
    response_body = models.JSONField(null=True, blank=True)
    error = models.JSONField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["line_number"]
        constraints = [models.UniqueConstraint(fields=["batch", "custom_id"], name="batch_line_unique_custom_id")]
        indexes = [models.Index(fields=["batch", "status", "line_number"])]

    def __str__(self) -> str:
        return f"{self.batch_id}:{self.custom_id} ({self.status})"
