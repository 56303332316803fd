"""quotas.services and selectors against the real test Redis and database."""

import time

import pytest
from django.contrib.auth import get_user_model

from errors import PlanViolation, QuotaExceeded
from openai_api.errors import error_body
from quotas import selectors, services
from quotas.ledger import QuotaLedger, Usage
from quotas.models import Plan, UserPlan

pytestmark = pytest.mark.django_db


@pytest.fixture
def user():
    return get_user_model().objects.create_user("quota-user", password="pw-123456!")


@pytest.fixture
def small_plan(user):
    plan = Plan.objects.create(
        name="small",
        tokens_per_day=300,
        tokens_per_month=1000,
        requests_per_minute=3,
        concurrent_requests=2,
        max_tokens_per_request=100,
        allowed_models=["tiny"],
    )
    UserPlan.objects.create(user=user, plan=plan)
    return plan


def test_default_plan_comes_from_settings(user, settings):
    settings.QUOTA_DEFAULT_PLAN = {"name": "free", "tokens_per_day": 5, "allowed_models": ["a"]}
    plan = selectors.plan_for(user)
    assert (plan.name, plan.tokens_per_day, plan.requests_per_minute, plan.allowed_models) == ("free", 5, None, ("a",))


def test_assigned_plan_overrides_the_default(user, small_plan):
    assert selectors.plan_for(user).name == "small"
    assert selectors.plan_for(user).concurrent_requests == 2


def test_concurrency_refusal_is_rate_limit_exceeded_with_headers(user, small_plan, isolated_quota_prefix):
    services.reserve(user, "tiny", 10, 20, source="test")
    services.reserve(user, "tiny", 10, 20, source="test")
    with pytest.raises(QuotaExceeded) as refused:
        services.reserve(user, "tiny", 10, 20, source="test")
    err = refused.value
    assert (err.code, err.limit, err.status) == ("rate_limit_exceeded", "concurrent_requests", 429)
    assert err.headers["Retry-After"] == "1"
    assert err.headers["x-ratelimit-limit-requests"] == "3"
    assert err.headers["x-ratelimit-remaining-requests"] == "1"
    assert error_body(err)["error"] == {
        "message": err.message,
        "type": "rate_limit_error",
        "param": None,
        "code": "rate_limit_exceeded",
    }


def test_token_budget_refusal_is_insufficient_quota(user, small_plan, isolated_quota_prefix):
    first = services.reserve(user, "tiny", 100, 100, source="test")
    with pytest.raises(QuotaExceeded) as refused:
        services.reserve(user, "tiny", 50, 100, source="test")  # 200 + 150 > 300 a day
    assert (refused.value.code, refused.value.limit) == ("insufficient_quota", "tokens_per_day")
    assert refused.value.retry_after >= 1
    assert error_body(refused.value)["error"]["type"] == "insufficient_quota"

    services.settle(first, 100, 10)  # actual usage 110 frees 90 reserved tokens
    services.reserve(user, "tiny", 50, 100, source="test")


def test_plan_violations_are_not_quota_refusals(user, small_plan, isolated_quota_prefix):
    with pytest.raises(PlanViolation) as wrong_model:
        services.reserve(user, "big", 1, 1, source="test")
    assert (wrong_model.value.code, wrong_model.value.param, wrong_model.value.status) == (
        "model_not_allowed",
        "model",
        403,
    )
    with pytest.raises(PlanViolation) as too_long:
        services.reserve(user, "tiny", 1, 101, source="test")
    assert too_long.value.param == "max_tokens"
    assert selectors.quota_status(user).usage.requests_last_minute == 0  # nothing was admitted


def test_settle_is_idempotent_and_frees_the_slot(user, small_plan, isolated_quota_prefix):
    reservation = services.reserve(user, "tiny", 10, 90, source="test")
    assert selectors.quota_status(user).usage.concurrent == 1
    assert services.settle(reservation, 10, 5) is True
    assert services.settle(reservation, 10, 5) is False
    assert services.settle(reservation, 10, 80) is False  # a late second settle changes nothing
    status = selectors.quota_status(user)
    assert (status.usage.concurrent, status.usage.tokens_today) == (0, 15)
    assert status.tokens_remaining_today == 285


def test_a_cut_stream_still_settles(user, small_plan, isolated_quota_prefix):
    """The pattern every streaming caller uses: settle in `finally`, with what was produced so far."""
    reservation = services.reserve(user, "tiny", 10, 90, source="test")
    produced = []

    def stream():
        try:
            for token in range(90):
                produced.append(token)
                yield token
        finally:
            services.settle(reservation, 10, len(produced))

    gen = stream()
    for _ in range(7):
        next(gen)
    gen.close()  # the client went away mid-stream
    status = selectors.quota_status(user)
    assert (status.usage.concurrent, status.usage.tokens_today) == (0, 17)


def test_a_vanished_clients_slot_is_released_by_its_lease(redis_client, prefix):
    from quotas.limits import PlanLimits

    ledger = QuotaLedger(redis_client, prefix=prefix, lease_seconds=0.3)
    limits = PlanLimits(concurrent_requests=1)
    held = ledger.reserve(1, limits, 1)
    assert ledger.reserve(1, limits, 1).limit == "concurrent_requests"
    time.sleep(0.4)  # never settled, never renewed
    assert not hasattr(ledger.reserve(1, limits, 1), "limit")
    assert ledger.renew(held) is False


def test_renew_keeps_a_long_request_slot(redis_client, prefix):
    from quotas.limits import PlanLimits

    ledger = QuotaLedger(redis_client, prefix=prefix, lease_seconds=0.4)
    limits = PlanLimits(concurrent_requests=1)
    held = ledger.reserve(1, limits, 1)
    for _ in range(3):
        time.sleep(0.2)
        assert ledger.renew(held)
    assert ledger.reserve(1, limits, 1).limit == "concurrent_requests"


def test_rate_limit_headers_report_remaining(user, small_plan, isolated_quota_prefix):
    services.reserve(user, "tiny", 20, 30, source="test")
    headers = services.rate_limit_headers(user)
    assert headers["x-ratelimit-limit-requests"] == "3"
    assert headers["x-ratelimit-remaining-requests"] == "2"
    assert headers["x-ratelimit-limit-tokens"] == "300"
    assert headers["x-ratelimit-remaining-tokens"] == "250"
    assert headers["x-ratelimit-reset-requests"].endswith("s")


def test_an_admission_carries_the_headers_a_read_back_would_give(user, small_plan, isolated_quota_prefix):
    """The reservation script returns the counters it just wrote: the /v1 headers need no second read."""
    services.reserve(user, "tiny", 5, 5, source="test")
    second = services.reserve(user, "tiny", 20, 30, source="test")
    assert second.usage == Usage(
        requests_last_minute=2,
        concurrent=2,
        tokens_today=60,
        tokens_this_month=60,
        requests_reset_s=second.usage.requests_reset_s,
    )
    assert 50 < second.usage.requests_reset_s <= 60  # the oldest admission leaves the window a minute on
    plan = selectors.plan_for(user)
    from_admission = services.rate_limit_headers(user, plan, second.usage)
    read_back = services.rate_limit_headers(user, plan)
    resets = from_admission.pop("x-ratelimit-reset-requests"), read_back.pop("x-ratelimit-reset-requests")
    assert from_admission == read_back and all(reset.endswith("s") for reset in resets)
    assert from_admission["x-ratelimit-remaining-requests"] == "1"
    assert from_admission["x-ratelimit-remaining-tokens"] == "240"
    assert "usage" not in second.as_dict() and type(second).from_dict(second.as_dict()) == second


def test_unlimited_plans_send_no_limit_headers(user, settings, isolated_quota_prefix):
    settings.QUOTA_DEFAULT_PLAN = {}
    services.reserve(user, "anything", 10, 10_000, source="test")
    assert services.rate_limit_headers(user) == {}


def test_format_reset():
    assert [selectors.format_reset(s) for s in (0.4, 59, 61, 3723)] == ["0s", "59s", "1m1s", "1h2m3s"]
