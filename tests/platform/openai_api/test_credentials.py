"""The /v1 credential cache: a known key costs no query, and no change to a key, a user or a plan is missed."""

from datetime import timedelta

import pytest
from django.contrib.auth.models import User
from django.utils import timezone

from accounts.models import ApiKey
from accounts.services import create_api_key, revoke_api_key
from common import connections
from openai_api import credentials
from quotas.models import Plan, UserPlan

pytestmark = pytest.mark.django_db


@pytest.fixture
def key_and_raw():
    user = User.objects.create_user("cache-user", password="pw-long-enough")
    return create_api_key(user)


def test_a_known_key_and_its_plan_cost_no_query(key_and_raw, django_assert_num_queries):
    key, raw = key_and_raw
    first_key, first_plan = credentials.caller(raw)
    assert first_key.pk == key.pk and ApiKey.objects.get(pk=key.pk).last_used_at is not None
    with django_assert_num_queries(0):
        assert credentials.caller(raw) == (first_key, first_plan)


def test_unknown_and_malformed_keys_are_refused(key_and_raw):
    _, raw = key_and_raw
    for bad in (None, "", "tsk-", raw[:-1], "sk-" + raw[4:]):
        assert credentials.caller(bad) is None


def test_a_revoked_key_or_deactivated_user_is_refused_on_the_next_request(key_and_raw):
    key, raw = key_and_raw
    assert credentials.caller(raw) is not None
    revoke_api_key(key)
    assert credentials.caller(raw) is None
    _, other = create_api_key(key.user)
    assert credentials.caller(other) is not None
    key.user.is_active = False
    key.user.save()
    assert credentials.caller(other) is None


def test_a_key_that_expires_while_cached_is_refused(key_and_raw):
    key, raw = key_and_raw
    key.expires_at = timezone.now() + timedelta(seconds=30)
    key.save()
    assert credentials.caller(raw) is not None
    cached_key = credentials.caller(raw)[0]
    cached_key.expires_at = timezone.now() - timedelta(seconds=1)  # as if the 30 s had passed
    ApiKey.objects.filter(pk=key.pk).update(expires_at=cached_key.expires_at)
    assert credentials.caller(raw) is None


def test_a_new_plan_applies_to_the_next_request(key_and_raw):
    key, raw = key_and_raw
    assert credentials.caller(raw)[1].name != "tight"
    plan = Plan.objects.create(name="tight", requests_per_minute=1)
    UserPlan.objects.create(user=key.user, plan=plan)
    assert credentials.caller(raw)[1].name == "tight"
    plan.requests_per_minute = 2
    plan.save()
    assert credentials.caller(raw)[1].requests_per_minute == 2


def test_a_change_committed_by_another_process_reaches_this_one(key_and_raw, django_capture_on_commit_callbacks):
    """Another process's commit moves the Redis counter; an update() sends no signal, so only the
    counter can tell this process."""
    key, raw = key_and_raw
    assert credentials.caller(raw) is not None
    ApiKey.objects.filter(pk=key.pk).update(revoked_at=timezone.now())  # no signal: this process still trusts it
    assert credentials.caller(raw) is not None
    connections.sync_redis().incr(credentials.EPOCH_KEY)  # what the other process's on_commit does
    assert credentials.caller(raw) is None
    epoch = int(connections.sync_redis().get(credentials.EPOCH_KEY))
    with django_capture_on_commit_callbacks(execute=True):
        revoke_api_key(key)
    assert int(connections.sync_redis().get(credentials.EPOCH_KEY)) == epoch + 1
