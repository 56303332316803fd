"""The engine, live: every worker's heartbeat and block map, summarised for the dashboard.

Reads go through engine_client (the only module that knows the engine's Redis keys); this module
only reshapes what the workers publish (docs/protocol.md, "Heartbeat") into one JSON snapshot,
sent over the dashboard websocket every second and served by GET /dashboard/api/engine/.
"""

from __future__ import annotations

import time
from collections import Counter

from engine_client import client
from inference.metrics import spec_decode_acceptance

from . import selectors

# One letter per block in the map sent to the browser.
FREE, CACHED, USED, SHARED = "f", "c", "u", "s"
# engine.block_map() codes each block as a digit: 0 free, 1 cached (free, keeps its prefix hash),
# 2 in use by one request, 3 shared by several. Names and letters are accepted too.
_CODES = (FREE, CACHED, USED, SHARED)
_STATE_NAMES = {
    "free": FREE,
    "f": FREE,
    "cached": CACHED,
    "c": CACHED,
    "used": USED,
    "in_use": USED,
    "u": USED,
    "shared": SHARED,
    "s": SHARED,
    **{str(i): letter for i, letter in enumerate(_CODES)},
}
MEMORY_KEYS = ("memory", "memory_budget")
TOP_REQUESTS = 8
TOP_TENANTS = 5  # the fair share panel's named tenants; the rest are summed
SPEC_COUNTS = ("drafts", "draft_tokens", "accepted_tokens")  # the heartbeat's spec_decode_num_{key}_total


def engine_snapshot() -> dict:
    """{"workers": [...], "totals": {...}, "tenant_shares": {...}, "at": unix s} from every live worker."""
    snapshot = summarize(client.workers(), client.block_maps(), now=time.time())
    name_tenants(snapshot["tenant_shares"])
    return snapshot


def summarize(workers: list[dict], block_maps: dict, now: float) -> dict:
    rows = [
        _worker_row(w, block_maps.get(w.get("worker_id")), now)
        for w in sorted(workers, key=lambda w: w.get("worker_id", ""))
    ]
    return {"at": now, "workers": rows, "totals": _totals(rows), "tenant_shares": tenant_shares(workers)}


def tenant_shares(workers: list[dict], top: int = TOP_TENANTS) -> dict:
    """Every worker's last-minute service per tenant (the heartbeat's `tenant_shares`: each worker's top
    tenants and the rest summed) merged into one view: the `top` tenants by served tokens with their
    share and weight, everyone else summed in `others`, so the panel stays small however many users."""
    tokens: dict[str, float] = {}
    weights: dict[str, float] = {}
    rest, window_s = 0.0, 0
    for worker in workers:
        shares = (worker.get("stats") or {}).get("tenant_shares") or {}
        window_s = max(window_s, int(shares.get("window_s") or 0))
        for row in shares.get("tenants") or []:
            tenant = str(row["tenant"])
            tokens[tenant] = tokens.get(tenant, 0.0) + float(row.get("tokens") or 0)
            weights[tenant] = float(row.get("weight") or 1.0)
        rest += float((shares.get("others") or {}).get("tokens") or 0)
    total = sum(tokens.values()) + rest
    ranked = sorted(tokens, key=lambda t: (-tokens[t], t))
    rest += sum(tokens[t] for t in ranked[top:])
    return {
        "window_s": window_s,
        "total_tokens": round(total),
        "tenants": [
            {"tenant": t, "name": t, "tokens": round(tokens[t]), "share": tokens[t] / total, "weight": weights[t]}
            for t in ranked[:top]
        ],
        "others": {"tokens": round(rest), "share": rest / total if total else 0.0},
    }


def name_tenants(shares: dict) -> None:
    """The platform's tenant is the user's id: show the username instead."""
    names = selectors.usernames(user_ids=[row["tenant"] for row in shares["tenants"]])
    for row in shares["tenants"]:
        row["name"] = names.get(row["tenant"], row["tenant"])


def _worker_row(info: dict, block_map, now: float) -> dict:
    stats = info.get("stats") or {}
    config = info.get("config") or {}
    updated = float(info.get("updated_at") or 0)
    started = float(info.get("started_at") or 0)
    return {
        "worker_id": info.get("worker_id", ""),
        "model": info.get("served_model_name") or info.get("model", ""),
        "host": info.get("host", ""),
        "pid": info.get("pid", ""),
        "heartbeat_age_s": round(max(0.0, now - updated), 2) if updated else None,
        "uptime_s": round(now - started) if started else None,
        "num_running": int(stats.get("num_running", 0) or 0),
        "num_waiting": int(stats.get("num_waiting", 0) or 0),
        "kv_usage": float(stats.get("kv_usage", 0) or 0),
        "prefix_cache_hit_rate": float(stats.get("prefix_cache_hit_rate", 0) or 0),
        "num_preemptions": int(stats.get("num_preemptions", 0) or 0),
        "spec_decode": {key: int(stats.get(f"spec_decode_num_{key}_total", 0) or 0) for key in SPEC_COUNTS},
        "tokens_per_s": float(stats.get("tokens_per_s", 0) or 0),
        "blocks_total": int(stats.get("blocks_total", 0) or 0),
        "step_ms": stats.get("step_ms"),
        "draining": bool(stats.get("draining", False)),
        "max_model_len": config.get("max_model_len"),
        "memory": memory_budget(stats, config),
        "block_map": normalize_block_map(block_map),
    }


def memory_budget(stats: dict, config: dict) -> dict | None:
    """The budget the worker computed at start-up (total, weights, activation peak, KV pool, ...)."""
    for source in (stats, config):
        for key in MEMORY_KEYS:
            if isinstance(source.get(key), dict):
                return source[key]
    return None


def normalize_block_map(raw) -> dict | None:
    """Any of the shapes a worker may publish -> {"blocks": "fcus..", "counts", "top_requests"}.

    The engine publishes {"block_size", "states": "0123...", "top_requests": [{request_id, blocks}]};
    also accepted: the states alone, as a string or a list of codes (0-3) or names.
    """
    if raw is None:
        return None
    top, block_size = [], None
    if isinstance(raw, dict):
        block_size = raw.get("block_size")
        top = _top_requests(raw.get("top_requests") or raw.get("requests") or [])
        raw = raw.get("blocks", raw.get("states", ""))
    blocks = "".join(_state_letter(item) for item in raw)
    counts = Counter(blocks)
    return {
        "blocks": blocks,
        "block_size": block_size,
        "counts": {
            name: counts.get(letter, 0)
            for name, letter in (("free", FREE), ("cached", CACHED), ("used", USED), ("shared", SHARED))
        },
        "top_requests": top[:TOP_REQUESTS],
    }


def _state_letter(item) -> str:
    if isinstance(item, bool):
        return USED if item else FREE
    if isinstance(item, int):
        return _CODES[min(max(item, 0), 3)]
    return _STATE_NAMES.get(str(item).lower(), FREE)


def _top_requests(raw) -> list[dict]:
    if isinstance(raw, dict):
        raw = [{"request_id": k, "blocks": v} for k, v in raw.items()]
    rows = [
        {"request_id": str(r.get("request_id", r.get("id", ""))), "blocks": int(r.get("blocks", 0))}
        for r in raw
        if isinstance(r, dict)
    ]
    return sorted(rows, key=lambda r: -r["blocks"])


def _totals(rows: list[dict]) -> dict:
    blocks = sum(r["blocks_total"] for r in rows)
    used = sum(r["kv_usage"] * r["blocks_total"] for r in rows)
    return {
        "workers": len(rows),
        "num_running": sum(r["num_running"] for r in rows),
        "num_waiting": sum(r["num_waiting"] for r in rows),
        # Pool-weighted: a big worker at 90% matters more than a small idle one.
        "kv_usage": round(used / blocks, 4)
        if blocks
        else (round(sum(r["kv_usage"] for r in rows) / len(rows), 4) if rows else 0.0),
        "prefix_cache_hit_rate": round(sum(r["prefix_cache_hit_rate"] for r in rows) / len(rows), 4) if rows else 0.0,
        "num_preemptions": sum(r["num_preemptions"] for r in rows),
        "tokens_per_s": round(sum(r["tokens_per_s"] for r in rows), 2),
        **spec_decode_rates({key: sum(r["spec_decode"][key] for r in rows) for key in SPEC_COUNTS}),
    }


def spec_decode_rates(counts: dict) -> dict:
    """vLLM's two figures over every worker's counters; None while nothing was speculated, so "off"
    reads differently from "0%"."""
    rate, length = spec_decode_acceptance(counts["drafts"], counts["draft_tokens"], counts["accepted_tokens"])
    speculated = counts["drafts"] > 0
    return {
        "spec_decode_acceptance_rate": round(rate, 4) if speculated else None,
        "spec_decode_mean_acceptance_length": round(length, 3) if speculated else None,
    }
