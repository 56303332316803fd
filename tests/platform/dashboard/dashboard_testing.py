"""Helpers shared by the dashboard tests (a module name no other test folder uses)."""

from __future__ import annotations

import json
import time
from datetime import datetime, timezone

import redis
from django.conf import settings

from inference import protocol

# A fixed "now" half-way through an hour, so hour buckets are deterministic.
NOW = datetime(2026, 11, 20, 14, 30, tzinfo=timezone.utc)


def fake_heartbeat(
    worker_id: str,
    *,
    running: int = 3,
    waiting: int = 1,
    kv_usage: float = 0.42,
    tokens_per_s: float = 123.4,
    states: str = "0011222233",
    ttl_s: float = 5.0,
    redis_url: str | None = None,
    tenant_shares: dict | None = None,
    spec_decode: tuple[int, int, int] | None = None,
) -> None:
    """Publish what an engine worker publishes (docs/protocol.md "Heartbeat"), with a short TTL."""
    r = redis.Redis.from_url(redis_url or settings.REDIS_URL)
    now = time.time()
    stats = {
        "num_running": running,
        "num_waiting": waiting,
        "kv_usage": kv_usage,
        "prefix_cache_hit_rate": 0.5,
        "num_preemptions": 2,
        "tokens_per_s": tokens_per_s,
        "blocks_total": len(states),
        "memory": {
            "total_bytes": 8 << 30,
            "weights_bytes": 1 << 30,
            "activation_peak_bytes": 256 << 20,
            "kv_pool_bytes": 4 << 30,
            "max_concurrency_at_max_model_len": 12.5,
        },
    }
    if tenant_shares is not None:
        stats["tenant_shares"] = tenant_shares
    if spec_decode is not None:  # verifications, proposed and accepted tokens
        for key, count in zip(("drafts", "draft_tokens", "accepted_tokens"), spec_decode):
            stats[f"spec_decode_num_{key}_total"] = count
    key = protocol.heartbeat_key(worker_id)
    pipe = r.pipeline()
    pipe.hset(
        key,
        mapping={
            "worker_id": worker_id,
            "model": "tiny-llama",
            "served_model_name": "tiny-llama",
            "pid": 4242,
            "host": "test-host",
            "started_at": now - 60,
            "updated_at": now,
            "stats": json.dumps(stats),
            "config": json.dumps({"max_model_len": 2048}),
        },
    )
    pipe.pexpire(key, int(ttl_s * 1000))
    pipe.sadd(protocol.WORKERS_SET, worker_id)
    pipe.set(
        protocol.block_map_key(worker_id),
        json.dumps(
            {
                "block_size": 16,
                "states": states,
                "top_requests": [{"request_id": "req-big", "blocks": 4}, {"request_id": "req-small", "blocks": 2}],
            }
        ),
        px=int(ttl_s * 1000),
    )
    pipe.execute()


def clear_heartbeat(worker_id: str, redis_url: str | None = None) -> None:
    r = redis.Redis.from_url(redis_url or settings.REDIS_URL)
    r.delete(protocol.heartbeat_key(worker_id), protocol.block_map_key(worker_id))
    r.srem(protocol.WORKERS_SET, worker_id)
