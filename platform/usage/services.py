"""Writes: record one request's usage (called by the API, the playground and the batch runner)."""

from __future__ import annotations

from .models import UsageRecord


def record_usage(
    *,
    user,
    source: str,
    endpoint: str = "",
    model: str = "",
    request_id: str = "",
    api_key=None,
    prompt_tokens: int = 0,
    completion_tokens: int = 0,
    cached_tokens: int = 0,
    ttft_ms: float | None = None,
    engine_ttft_ms: float | None = None,
    latency_ms: float | None = None,
    status_code: int = 200,
    error_code: str = "",
    end_user: str = "",
) -> UsageRecord:
    """Store one usage row; errors are recorded too (status_code/error_code) so rates can be charted.

    ttft_ms: from the request's arrival; engine_ttft_ms: from the worker's acceptance (models.py)."""
    if source not in UsageRecord.Source.values:
        raise ValueError(f"unknown usage source {source!r}")
    return UsageRecord.objects.create(
        user=user,
        api_key=api_key,
        source=source,
        endpoint=endpoint,
        model=model,
        request_id=request_id,
        prompt_tokens=int(prompt_tokens or 0),
        completion_tokens=int(completion_tokens or 0),
        cached_tokens=int(cached_tokens or 0),
        ttft_ms=ttft_ms,
        engine_ttft_ms=engine_ttft_ms,
        latency_ms=latency_ms,
        status_code=int(status_code),
        error_code=error_code or "",
        end_user=end_user or "",
    )
