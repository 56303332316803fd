"""Sign up, log in, log out, password change and the API key pages (throttling: test_login_throttle.py)."""

import pytest
from django.contrib.auth import get_user_model
from django.urls import reverse

from accounts.models import ApiKey
from accounts.services import authenticate_api_key, create_api_key

pytestmark = pytest.mark.django_db
PASSWORD = "a-Long-pass-123"


@pytest.fixture
def user():
    return get_user_model().objects.create_user("bob", password=PASSWORD)


@pytest.fixture(autouse=True)
def fresh_throttle(settings):
    """Each test gets its own client address, so login counters never leak between tests."""
    import uuid

    return f"10.0.{uuid.uuid4().int % 250}.{uuid.uuid4().int % 250}"


def test_signup_logs_the_new_user_in(client):
    response = client.post(
        reverse("accounts:signup"), {"username": "newbie", "email": "", "password1": PASSWORD, "password2": PASSWORD}
    )
    assert response.status_code == 302 and response["Location"] == reverse("chat:playground")
    assert client.get(reverse("chat:playground")).context["user"].username == "newbie"


def test_signup_rejects_mismatched_passwords(client):
    response = client.post(reverse("accounts:signup"), {"username": "x", "password1": PASSWORD, "password2": "nope"})
    assert response.status_code == 200 and not get_user_model().objects.filter(username="x").exists()


def test_login_and_logout(client, user, fresh_throttle):
    response = client.post(
        reverse("accounts:login"), {"username": "bob", "password": PASSWORD}, REMOTE_ADDR=fresh_throttle
    )
    assert response.status_code == 302
    assert client.post(reverse("accounts:logout")).status_code == 302
    assert client.get(reverse("history:usage")).status_code == 302


def test_password_change(client, user):
    client.force_login(user)
    response = client.post(
        reverse("accounts:password_change"),
        {"old_password": PASSWORD, "new_password1": "An0ther-long-pass", "new_password2": "An0ther-long-pass"},
    )
    assert response.status_code == 302
    user.refresh_from_db()
    assert user.check_password("An0ther-long-pass")


def test_api_key_is_shown_once_listed_and_revocable(client, user):
    client.force_login(user)
    created = client.post(reverse("accounts:api_keys"), {"name": "laptop", "expires_in_days": "30"})
    raw = created.context["new_key"]
    assert raw.startswith("tsk-") and raw in created.content.decode()
    assert created["Cache-Control"] == "no-store"
    key = ApiKey.objects.get(user=user)
    assert key.name == "laptop" and key.expires_at is not None
    assert authenticate_api_key(raw) == key

    listing = client.get(reverse("accounts:api_keys")).content.decode()
    assert raw not in listing and key.prefix in listing  # never shown again

    client.post(reverse("accounts:api_key_revoke", args=[key.pk]))
    key.refresh_from_db()
    assert key.is_revoked and authenticate_api_key(raw) is None


def test_another_users_key_cannot_be_revoked(client, user):
    other = get_user_model().objects.create_user("eve", password=PASSWORD)
    key, raw = create_api_key(user, "mine")
    client.force_login(other)
    assert client.post(reverse("accounts:api_key_revoke", args=[key.pk])).status_code == 404
    assert key.prefix not in client.get(reverse("accounts:api_keys")).content.decode()
    assert authenticate_api_key(raw) == key


def test_base_layout_navigation(client, user):
    client.force_login(user)
    html = client.get(reverse("history:usage")).content.decode()
    for label in ("Playground", "History", "Usage", "API keys", "Batches"):
        assert f">{label}</a>" in html
    assert "Dashboard" not in html
    user.is_staff = True
    user.save()
    assert ">Dashboard</a>" in client.get(reverse("history:usage")).content.decode()
