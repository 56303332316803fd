"""API keys: shown once, stored hashed with a visible prefix, revocable, expiring."""

from datetime import timedelta

import pytest
from django.contrib.auth.models import User
from django.core.management import call_command
from django.utils import timezone

from accounts.models import ApiKey
from accounts.selectors import api_key_for, api_keys_for
from accounts.services import authenticate_api_key, create_api_key, hash_key, revoke_api_key

pytestmark = pytest.mark.django_db


@pytest.fixture
def user():
    return User.objects.create_user("ada", password="pw-long-enough")


def test_create_returns_the_raw_key_once_and_stores_only_its_hash(user):
    key, raw = create_api_key(user, name="laptop")
    assert raw.startswith("tsk-") and len(raw) > 40
    stored = ApiKey.objects.get(pk=key.pk)
    assert stored.hashed_key == hash_key(raw) and raw not in stored.hashed_key
    assert raw.startswith(stored.prefix) and len(stored.prefix) == 12
    assert not any(raw == getattr(stored, f.attname) for f in ApiKey._meta.concrete_fields)


def test_authenticate_accepts_active_keys_and_touches_last_used(user):
    key, raw = create_api_key(user)
    assert key.last_used_at is None
    found = authenticate_api_key(raw)
    assert found.pk == key.pk and found.user == user
    assert ApiKey.objects.get(pk=key.pk).last_used_at is not None


@pytest.mark.parametrize("raw", [None, "", "tsk-", "tsk-nope", "sk-something", "Bearer tsk-x"])
def test_authenticate_rejects_unknown_keys(user, raw):
    create_api_key(user)
    assert authenticate_api_key(raw) is None


def test_revoked_expired_and_inactive_user_keys_are_rejected(user):
    revoked, raw_revoked = create_api_key(user)
    revoke_api_key(revoked)
    first = revoked.revoked_at
    revoke_api_key(revoked)
    assert revoked.revoked_at == first, "revocation is idempotent"
    _, raw_expired = create_api_key(user, expires_at=timezone.now() - timedelta(seconds=1))
    _, raw_future = create_api_key(user, expires_at=timezone.now() + timedelta(days=1))
    assert authenticate_api_key(raw_revoked) is None
    assert authenticate_api_key(raw_expired) is None
    assert authenticate_api_key(raw_future) is not None
    user.is_active = False
    user.save()
    assert authenticate_api_key(raw_future) is None


def test_selectors_only_see_the_users_own_keys(user):
    other = User.objects.create_user("bob", password="pw-long-enough")
    mine, _ = create_api_key(user)
    theirs, _ = create_api_key(other)
    assert list(api_keys_for(user)) == [mine]
    assert api_key_for(user, theirs.pk) is None and api_key_for(user, mine.pk) == mine


def test_create_api_key_command_prints_the_key_alone_on_the_last_line(user, capsys):
    call_command("create_api_key", "ada", "--name", "ci")
    last = capsys.readouterr().out.strip().splitlines()[-1]
    key = authenticate_api_key(last)
    assert key is not None and key.name == "ci" and key.user == user


def test_create_api_key_command_refuses_unknown_users():
    from django.core.management.base import CommandError

    with pytest.raises(CommandError):
        call_command("create_api_key", "nobody")
