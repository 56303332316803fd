"""Live engine state: block-map decoding, totals across workers, and the staff-only websocket."""

import pytest
from asgiref.sync import async_to_sync
from channels.routing import URLRouter
from channels.testing import WebsocketCommunicator
from django.contrib.auth.models import AnonymousUser

from dashboard import live
from dashboard.routing import websocket_urlpatterns


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
    }
    assert [w["heartbeat_age_s"] for w in snap["workers"]] == [0.5, 1.0]


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
