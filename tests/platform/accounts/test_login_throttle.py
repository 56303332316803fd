"""Log-in throttling on the site login and /admin/login/, keyed so that nobody can lock out someone else."""

from __future__ import annotations

import uuid

import pytest
from django.contrib.auth import get_user_model
from django.test import Client
from django.urls import reverse

pytestmark = pytest.mark.django_db
PASSWORD = "a-Long-pass-123"
LOCKED = "Too many failed log-in attempts"


def _address() -> str:
    value = uuid.uuid4().int
    return f"10.{value % 250}.{value // 250 % 250}.{value // 62500 % 250}"


def _name() -> str:
    return "u" + uuid.uuid4().hex[:12]  # counters live in the session's Redis: fresh names per test


def _user(**extra):
    return get_user_model().objects.create_user(_name(), password=PASSWORD, **extra)


def _login(username: str, password: str, address: str, url: str | None = None):
    client = Client()
    response = client.post(
        url or reverse("accounts:login"), {"username": username, "password": password}, REMOTE_ADDR=address
    )
    return response, client


def _logged_in(response, client) -> bool:
    return response.status_code == 302 and "_auth_user_id" in client.session


def test_failures_lock_that_address_out_of_that_account_only(settings):
    settings.LOGIN_ATTEMPTS_PER_15_MIN = 3
    victim, attacker = _user(), _address()
    for _ in range(3):
        bad, _ = _login(victim.username, "wrong", attacker)
        assert bad.status_code == 200 and LOCKED not in bad.content.decode()
    locked, client = _login(victim.username, PASSWORD, attacker)  # even the right password, from there
    assert LOCKED in locked.content.decode() and not _logged_in(locked, client)
    assert _logged_in(*_login(victim.username, PASSWORD, _address()))  # the owner, from anywhere else


def test_an_address_failing_one_account_can_still_log_in_to_another(settings):
    settings.LOGIN_ATTEMPTS_PER_15_MIN = 3
    first, second, shared = _user(), _user(), _address()  # two people behind one NAT
    for _ in range(5):
        _login(first.username, "wrong", shared)
    assert _logged_in(*_login(second.username, PASSWORD, shared))


def test_one_account_guessed_from_many_addresses_stops_new_addresses_but_not_known_ones(settings):
    settings.LOGIN_FAILURES_PER_USERNAME = 4
    victim, home = _user(), _address()
    assert _logged_in(*_login(victim.username, PASSWORD, home))
    for _ in range(4):  # a botnet: one failure per address, never tripping a pair lock
        _login(victim.username, "wrong", _address())
    locked, client = _login(victim.username, PASSWORD, _address())
    assert LOCKED in locked.content.decode() and not _logged_in(locked, client)
    assert _logged_in(*_login(victim.username, PASSWORD, home))  # the owner's usual address still works


def test_password_spraying_from_one_address_stops_it_for_accounts_it_never_logged_in_to(settings):
    settings.LOGIN_FAILURES_PER_ADDRESS = 4
    sprayer = _address()
    regular = _user()
    assert _logged_in(*_login(regular.username, PASSWORD, sprayer))
    for _ in range(4):
        _login(_user().username, "wrong", sprayer)
    fresh = _user()
    locked, client = _login(fresh.username, PASSWORD, sprayer)
    assert LOCKED in locked.content.decode() and not _logged_in(locked, client)
    assert _logged_in(*_login(fresh.username, PASSWORD, _address()))
    assert _logged_in(*_login(regular.username, PASSWORD, sprayer))


def test_usernames_differing_in_case_share_a_counter(settings):
    settings.LOGIN_ATTEMPTS_PER_15_MIN = 2
    victim, attacker = _user(), _address()
    _login(victim.username.upper(), "wrong", attacker)
    _login(" " + victim.username, "wrong", attacker)
    assert LOCKED in _login(victim.username, PASSWORD, attacker)[0].content.decode()


def test_admin_login_is_throttled_like_the_site_login(settings):
    settings.LOGIN_ATTEMPTS_PER_15_MIN = 5
    admin, attacker, url = _user(is_staff=True, is_superuser=True), _address(), reverse("admin:login")
    for _ in range(20):  # the probe of issue 21: 20 wrong passwords, then the right one
        _login(admin.username, "wrong", attacker, url)
    locked, client = _login(admin.username, PASSWORD, attacker, url)
    assert locked.status_code == 200 and LOCKED in locked.content.decode() and not _logged_in(locked, client)
    assert _logged_in(*_login(admin.username, PASSWORD, _address(), url))


def test_site_and_admin_failures_count_together(settings):
    settings.LOGIN_ATTEMPTS_PER_15_MIN = 4
    admin, attacker = _user(is_staff=True), _address()
    for url in (reverse("accounts:login"), reverse("admin:login")) * 2:
        _login(admin.username, "wrong", attacker, url)
    assert LOCKED in _login(admin.username, PASSWORD, attacker, reverse("admin:login"))[0].content.decode()


def test_a_success_clears_the_pairs_failures(settings):
    settings.LOGIN_ATTEMPTS_PER_15_MIN = 3
    user, address = _user(), _address()
    for _ in range(2):
        _login(user.username, "wrong", address)
    assert _logged_in(*_login(user.username, PASSWORD, address))
    for _ in range(2):
        _login(user.username, "wrong", address)
    assert _logged_in(*_login(user.username, PASSWORD, address))


@pytest.fixture
def redis_stopped(settings, tmp_path):
    """settings.REDIS_URL at a real redis-server that has been stopped."""
    from tessera import embedded_redis

    url, process = embedded_redis.start(data_dir=str(tmp_path))
    process.terminate()
    process.wait(10)
    settings.REDIS_URL = url
    return url


def test_with_redis_down_log_in_fails_closed_with_a_reason_not_a_500(redis_stopped):
    user = _user()
    for url in (reverse("accounts:login"), reverse("admin:login")):
        response, client = _login(user.username, PASSWORD, _address(), url)
        assert response.status_code == 200 and "Log-in is unavailable for a moment" in response.content.decode()
        assert not _logged_in(response, client)


def test_with_redis_down_sign_up_is_refused_and_creates_nothing(redis_stopped):
    response = Client().post(
        reverse("accounts:signup"),
        {"username": "late", "password1": PASSWORD, "password2": PASSWORD},
        REMOTE_ADDR=_address(),
    )
    assert response.status_code == 503 and "Sign-up is unavailable" in response.content.decode()
    assert not get_user_model().objects.filter(username="late").exists()
