import pytest
from django.contrib.auth.models import User

from accounts.services import create_api_key
from usage.models import UsageRecord
from usage.services import record_usage

pytestmark = pytest.mark.django_db


def test_record_usage_stores_every_field():
    user = User.objects.create_user("ada", password="pw-long-enough")
    key, _ = create_api_key(user)
    row = record_usage(
        user=user,
        api_key=key,
        source="api",
        endpoint="/v1/completions",
        model="tiny",
        request_id="cmpl-1",
        prompt_tokens=5,
        completion_tokens=7,
        cached_tokens=2,
        ttft_ms=12.5,
        engine_ttft_ms=4.5,
        latency_ms=40.0,
        status_code=200,
    )
    stored = UsageRecord.objects.get(pk=row.pk)
    assert (stored.ttft_ms, stored.engine_ttft_ms, stored.latency_ms) == (12.5, 4.5, 40.0)
    assert (stored.user, stored.api_key, stored.source, stored.total_tokens, stored.cached_tokens) == (
        user,
        key,
        "api",
        12,
        2,
    )
    assert stored.created_at is not None and stored.error_code == ""


def test_record_usage_refuses_unknown_sources_and_keeps_errors():
    user = User.objects.create_user("bob", password="pw-long-enough")
    with pytest.raises(ValueError):
        record_usage(user=user, source="fax")
    row = record_usage(user=user, source="playground", status_code=499, error_code="client_disconnected")
    assert row.api_key is None and row.status_code == 499
