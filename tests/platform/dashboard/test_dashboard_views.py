"""The dashboard page and its JSON feeds exist for staff only; everyone else gets 404."""

import pytest
from django.urls import reverse

pytestmark = pytest.mark.django_db

PAGES = ["dashboard:index", "dashboard:usage-json", "dashboard:engine-json"]


@pytest.mark.parametrize("name", PAGES)
def test_anonymous_gets_404(client, name):
    assert client.get(reverse(name)).status_code == 404


@pytest.mark.parametrize("name", PAGES)
def test_non_staff_gets_404(client, plain_user, name):
    client.force_login(plain_user)
    assert client.get(reverse(name)).status_code == 404
    assert client.post(reverse(name)).status_code == 404  # not 405: nothing is revealed


def test_inactive_staff_gets_404(client, staff_user):
    client.force_login(staff_user)
    staff_user.is_active = False
    staff_user.save()
    assert client.get(reverse("dashboard:index")).status_code == 404


def test_non_staff_cannot_drill_down(client, plain_user, staff_user):
    client.force_login(plain_user)
    assert client.get(reverse("dashboard:user", args=[plain_user.pk])).status_code == 404
    assert client.get(reverse("dashboard:user-json", args=[staff_user.pk])).status_code == 404


def test_staff_sees_the_page_with_local_chart_library(client, staff_user):
    client.force_login(staff_user)
    response = client.get(reverse("dashboard:index"))
    assert response.status_code == 200
    html = response.content.decode()
    assert "/static/vendor/chart.umd.min.js" in html  # served by us, from npm, not a CDN
    assert "cdn" not in html.lower()
    assert 'data-ws-path="/ws/dashboard/engine/"' in html


def test_staff_usage_feed_has_every_section(client, staff_user, recent_usage):
    client.force_login(staff_user)
    data = client.get(reverse("dashboard:usage-json"), {"range": "30d"}).json()
    assert set(data) >= {
        "window",
        "totals",
        "over_time",
        "by_model",
        "by_source",
        "model_over_time",
        "source_over_time",
        "top_users",
        "top_api_keys",
        "latency_over_time",
        "quotas",
        "batches",
    }
    assert data["window"]["bucket"] == "day" and len(data["over_time"]) == 30
    assert data["totals"]["requests"] == sum(b["requests"] for b in data["over_time"]) > 0
    assert {r["source"] for r in data["by_source"]} <= {"api", "playground", "batch"}


def test_staff_drilldown_feed(client, staff_user, recent_usage):
    from django.contrib.auth import get_user_model

    client.force_login(staff_user)
    demo = get_user_model().objects.get(username="demo-user-01")
    assert client.get(reverse("dashboard:user", args=[demo.pk])).status_code == 200
    data = client.get(reverse("dashboard:user-json", args=[demo.pk]), {"range": "30d"}).json()
    assert data["user"]["username"] == "demo-user-01"
    assert set(data) >= {"totals", "over_time", "by_model", "by_source", "api_keys", "latency_over_time", "quota"}
    assert client.get(reverse("dashboard:user-json", args=[999999])).status_code == 404


def test_staff_engine_feed_reads_worker_heartbeats(client, staff_user, fake_worker):
    client.force_login(staff_user)
    data = client.get(reverse("dashboard:engine-json")).json()
    mine = [w for w in data["workers"] if w["worker_id"] == fake_worker]
    assert len(mine) == 1
    worker = mine[0]
    assert worker["model"] == "tiny-llama" and worker["num_running"] == 3 and worker["kv_usage"] == 0.42
    assert worker["memory"]["kv_pool_bytes"] == 4 << 30
    assert worker["block_map"]["blocks"] == "ffccuuuuss"
    assert worker["block_map"]["top_requests"][0] == {"request_id": "req-big", "blocks": 4}
    assert data["totals"]["num_running"] >= 3
