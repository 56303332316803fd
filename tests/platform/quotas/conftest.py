import uuid

import pytest
import redis
from django.conf import settings

from quotas.ledger import QuotaLedger


@pytest.fixture
def redis_client():
    client = redis.Redis.from_url(settings.REDIS_URL)
    yield client
    client.close()


@pytest.fixture
def prefix():
    """A fresh key prefix, so tests never see each other's counters."""
    return f"qtest-{uuid.uuid4().hex[:8]}"


@pytest.fixture
def ledger(redis_client, prefix):
    return QuotaLedger(redis_client, prefix=prefix, lease_seconds=60)


@pytest.fixture
def isolated_quota_prefix(settings, prefix):
    """Points quotas.services at a fresh prefix (the service layer reads settings)."""
    settings.QUOTA_REDIS_PREFIX = prefix
    return prefix
