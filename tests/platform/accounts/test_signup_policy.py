"""Sign-up: ALLOW_SIGNUP, a per-address throttle, and SIGNUP_REQUIRES_APPROVAL (inactive until an admin approves)."""

from __future__ import annotations

import uuid

import pytest
from django.contrib.auth import get_user_model
from django.test import Client
from django.urls import reverse

from accounts.services import create_api_key
from tests.platform.security.asgi_calls import call

pytestmark = pytest.mark.django_db(transaction=True)
PASSWORD = "a-Long-pass-123"


def _address() -> str:
    value = uuid.uuid4().int
    return f"10.{value % 250}.{value // 250 % 250}.{value // 62500 % 250}"


def _signup(client: Client, address: str, username: str | None = None):
    username = username or "n" + uuid.uuid4().hex[:10]
    response = client.post(
        reverse("accounts:signup"),
        {"username": username, "email": "", "password1": PASSWORD, "password2": PASSWORD},
        REMOTE_ADDR=address,
    )
    return response, username


def _exists(username: str) -> bool:
    return get_user_model().objects.filter(username=username).exists()


def test_signup_closed_refuses_and_hides_the_links(settings):
    settings.ALLOW_SIGNUP = False
    client = Client()
    assert client.get(reverse("accounts:signup")).status_code == 403
    response, username = _signup(client, _address())
    assert response.status_code == 403 and not _exists(username)
    login_page = client.get(reverse("accounts:login")).content.decode()
    assert reverse("accounts:signup") not in login_page
    settings.ALLOW_SIGNUP = True
    assert reverse("accounts:signup") in client.get(reverse("accounts:login")).content.decode()


def test_signups_are_throttled_per_address(settings):
    settings.SIGNUPS_PER_HOUR_PER_ADDRESS = 2
    address = _address()
    for _ in range(2):
        response, username = _signup(Client(), address)
        assert response.status_code == 302 and _exists(username)
    refused, username = _signup(Client(), address)
    assert refused.status_code == 429 and "Too many new accounts" in refused.content.decode()
    assert not _exists(username)
    response, username = _signup(Client(), _address())
    assert response.status_code == 302 and _exists(username)


def test_an_account_awaiting_approval_cannot_log_in_or_use_a_key_until_an_admin_approves(settings):
    settings.SIGNUP_REQUIRES_APPROVAL = True
    client, address = Client(), _address()
    response, username = _signup(client, address)
    assert response.status_code == 302 and response["Location"] == reverse("accounts:login")
    assert "_auth_user_id" not in client.session
    user = get_user_model().objects.get(username=username)
    assert not user.is_active
    _key, raw = create_api_key(user)  # e.g. made by an admin on the command line
    assert call("GET", "/v1/models", headers={"Authorization": f"Bearer {raw}"}).status_code == 401

    pending = client.post(reverse("accounts:login"), {"username": username, "password": PASSWORD}, REMOTE_ADDR=address)
    assert "waiting for an administrator" in pending.content.decode() and "_auth_user_id" not in client.session
    wrong = client.post(reverse("accounts:login"), {"username": username, "password": "nope"}, REMOTE_ADDR=address)
    assert "waiting for an administrator" not in wrong.content.decode()  # only the password's owner learns it

    admin = Client()
    admin.force_login(get_user_model().objects.create_superuser("root" + uuid.uuid4().hex[:6], "", PASSWORD))
    approved = admin.post(
        reverse("admin:auth_user_changelist"), {"action": "approve_accounts", "_selected_action": [user.pk]}
    )
    assert approved.status_code == 302
    user.refresh_from_db()
    assert user.is_active
    assert call("GET", "/v1/models", headers={"Authorization": f"Bearer {raw}"}).status_code == 200
    client.post(reverse("accounts:login"), {"username": username, "password": PASSWORD}, REMOTE_ADDR=address)
    assert "_auth_user_id" in client.session


def test_without_approval_a_new_account_is_active_and_logged_in():
    client = Client()
    response, username = _signup(client, _address())
    assert response["Location"] == reverse("chat:playground") and "_auth_user_id" in client.session
    assert get_user_model().objects.get(username=username).is_active
