"""Live engine state: block-map decoding, totals across workers, and the staff-only websocket."""

import time

import pytest
from asgiref.sync import async_to_sync
from channels.routing import URLRouter
from channels.testing import WebsocketCommunicator
from dashboard_testing import clear_heartbeat, fake_heartbeat
from django.contrib.auth.models import AnonymousUser
from django.urls import reverse

from dashboard import live
from dashboard.routing import websocket_urlpatterns
from inference.fairness import ServiceWindow


def test_block_map_from_the_engine_format():
    raw = {
        "block_size": 16,
        "states": "0123301",
        "top_requests": [{"request_id": "a", "blocks": 1}, {"request_id": "b", "blocks": 3}],
    }
    got = live.normalize_block_map(raw)
    assert got["blocks"] == "fcussfc"
    assert got["counts"] == {"free": 2, "cached": 2, "used": 1, "shared": 2}
    assert [r["request_id"] for r in got["top_requests"]] == ["b", "a"]
    assert got["block_size"] == 16


def test_block_map_from_a_list_of_codes_or_names():
    assert live.normalize_block_map([0, 1, 2, 3])["blocks"] == "fcus"
    assert live.normalize_block_map(["free", "shared", "used"])["blocks"] == "fsu"
    assert live.normalize_block_map(None) is None


def test_totals_weight_kv_usage_by_pool_size():
    workers = [
        {
            "worker_id": "big",
            "updated_at": 99.5,
            "stats": {
                "kv_usage": 0.9,
                "blocks_total": 900,
                "num_running": 5,
                "tokens_per_s": 100.0,
                "num_preemptions": 1,
            },
        },
        {
            "worker_id": "small",
            "updated_at": 99.0,
            "stats": {"kv_usage": 0.0, "blocks_total": 100, "num_waiting": 2, "tokens_per_s": 50.5},
        },
    ]
    snap = live.summarize(workers, {}, now=100.0)
    assert snap["totals"] == {
        "workers": 2,
        "num_running": 5,
        "num_waiting": 2,
        "kv_usage": 0.81,
        "prefix_cache_hit_rate": 0.0,
        "num_preemptions": 1,
        "tokens_per_s": 150.5,
        "spec_decode_acceptance_rate": None,  # nothing speculated: "off", not 0%
        "spec_decode_mean_acceptance_length": None,
    }
    assert [w["heartbeat_age_s"] for w in snap["workers"]] == [0.5, 1.0]


def test_speculation_figures_are_taken_over_every_workers_counters():
    def worker(worker_id, drafts, proposed, accepted):
        stats = {
            "spec_decode_num_drafts_total": drafts,
            "spec_decode_num_draft_tokens_total": proposed,
            "spec_decode_num_accepted_tokens_total": accepted,
        }
        return {"worker_id": worker_id, "updated_at": 99.0, "stats": stats}

    totals = live.summarize([worker("a", 10, 40, 30), worker("b", 30, 60, 10)], {}, now=100.0)["totals"]
    assert totals["spec_decode_acceptance_rate"] == 0.4  # 40 of 100 proposed, not the mean of 75% and 17%
    assert totals["spec_decode_mean_acceptance_length"] == 2.0  # 1 + 40 accepted / 40 verifications


def _communicator(user):
    async def with_user(scope, receive, send):
        scope["user"] = user
        return await URLRouter(websocket_urlpatterns)(scope, receive, send)

    return WebsocketCommunicator(with_user, "/ws/dashboard/engine/")


@async_to_sync
async def _try_connect(user):
    communicator = _communicator(user)
    connected, _ = await communicator.connect()
    await communicator.disconnect()
    return connected


@pytest.mark.django_db
def test_websocket_refuses_anonymous_and_non_staff(plain_user):
    assert _try_connect(AnonymousUser()) is False
    assert _try_connect(plain_user) is False


@async_to_sync
async def _two_frames(user):
    communicator = _communicator(user)
    connected, _ = await communicator.connect()
    assert connected
    frames = [await communicator.receive_json_from(timeout=5) for _ in range(2)]
    await communicator.disconnect()
    return frames


@pytest.mark.django_db
def test_websocket_streams_snapshots_to_staff(staff_user, fake_worker, settings):
    settings.DASHBOARD_LIVE_INTERVAL_S = 0.2
    frames = _two_frames(staff_user)
    for frame in frames:
        assert frame["type"] == "engine"
        worker = next(w for w in frame["workers"] if w["worker_id"] == fake_worker)
        assert worker["num_running"] == 3 and worker["block_map"]["counts"]["used"] == 4
    assert frames[1]["at"] > frames[0]["at"]


def _window_shares(served: dict) -> dict:
    """A worker's heartbeat `tenant_shares`, made by the engine's own one-minute window."""
    window = ServiceWindow(clock=lambda: 1000.0)
    for tenant, (tokens, weight) in served.items():
        window.add(tenant, tokens, weight)
    return window.shares()


def test_tenant_shares_merge_workers_top_tenants_and_the_rest_summed():
    first = _window_shares({"1": (600, 1.0), "2": (300, 2.0), None: (100, 1.0)})
    second = _window_shares({"1": (200, 1.0), "3": (100, 1.0), **{str(t): (10, 1.0) for t in range(10, 17)}})
    assert len(second["tenants"]) == 5 and second["others"]["tokens"] == 40  # the engine's own bound
    workers = [
        {"worker_id": "a", "stats": {"tenant_shares": first}},
        {"worker_id": "b", "stats": {"tenant_shares": second}},
    ]
    shares = live.summarize(workers, {}, now=0.0)["tenant_shares"]
    assert shares["window_s"] == 60 and shares["total_tokens"] == 1370
    named = [(r["tenant"], r["tokens"], r["weight"]) for r in shares["tenants"]]
    assert named[:3] == [("1", 800, 1.0), ("2", 300, 2.0), ("3", 100, 1.0)]
    assert len(named) == live.TOP_TENANTS and all(tokens == 10 for _, tokens, _ in named[3:])
    # No tenant (100), the second worker's own rest (40) and its one small tenant past the merged top five.
    assert shares["others"]["tokens"] == 150
    assert sum(r["share"] for r in shares["tenants"]) + shares["others"]["share"] == pytest.approx(1.0)
    assert shares["tenants"][0]["share"] == pytest.approx(800 / 1370)


def test_tenant_shares_empty_without_service():
    shares = live.summarize([{"worker_id": "idle", "stats": {}}], {}, now=0.0)["tenant_shares"]
    assert shares == {"window_s": 0, "total_tokens": 0, "tenants": [], "others": {"tokens": 0, "share": 0.0}}


@pytest.mark.django_db
def test_engine_feed_names_tenants_by_username(client, staff_user, plain_user):
    worker_id = f"dash-fair-{time.monotonic_ns()}"
    shares = _window_shares({str(plain_user.pk): (300, 2.0), str(staff_user.pk): (100, 1.0), "not-a-user": (50, 1.0)})
    fake_heartbeat(worker_id, tenant_shares=shares)
    try:
        client.force_login(staff_user)
        data = client.get(reverse("dashboard:engine-json")).json()
    finally:
        clear_heartbeat(worker_id)
    rows = {r["name"]: (r["tokens"], r["weight"]) for r in data["tenant_shares"]["tenants"]}
    assert rows == {"alice": (300, 2.0), "ops": (100, 1.0), "not-a-user": (50, 1.0)}
