"""Prometheus text exposition: engine gauges from every worker's heartbeat plus /v1 HTTP counters.

HTTP counters live in Redis (not per process) so every web replica reports the same totals.
Other apps add lines by appending a callable to EXTRA_COLLECTORS (each returns a list of lines).
"""
from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable

from django.urls import Resolver404, resolve

from engine_client import client as engine
from tessera import http_guards

log = logging.getLogger("tessera.api")

HTTP_REQUESTS_KEY = "tessera:http:requests"
HTTP_SECONDS_KEY = "tessera:http:seconds"
EXTRA_COLLECTORS: list[Callable[[], list[str]]] = []
GAUGES_NAMED_TOTAL = {"tessera_engine_blocks_total"}  # a size, not a running count
COUNT_FAILURE_LOG_INTERVAL_S = 60.0


def _route(request) -> str:
    """The route template (never the raw path, so paths cannot add series); "unmatched" for none."""
    match = getattr(request, "resolver_match", None)
    if match is None:  # answered before URL resolution (OPTIONS, a refused body)
        try:
            match = resolve(request.path_info)
        except Resolver404:
            return "unmatched"
    return "/" + match.route if match.route else "unmatched"


def _count_ops(pipe, request, status: int, seconds: float):
    route, method = _route(request), http_guards.metric_method(request.method)
    pipe.hincrby(HTTP_REQUESTS_KEY, f"{route}|{method}|{status}", 1)
    pipe.hincrbyfloat(HTTP_SECONDS_KEY, f"{route}|{method}", seconds)
    return pipe


def count_request(request, status: int, seconds: float) -> None:
    try:
        _count_ops(engine.redis_client().pipeline(transaction=False), request, status, seconds).execute()
    except Exception as exc:  # counting must never replace the answer it counts
        _log_count_failure(exc)


async def acount_request(request, status: int, seconds: float) -> None:
    """count_request on the event loop (no thread hop before a stream's first byte)."""
    try:
        await _count_ops(engine.async_redis_client().pipeline(transaction=False), request, status, seconds).execute()
    except Exception as exc:
        _log_count_failure(exc)


_last_failure_log = [float("-inf")]


def _log_count_failure(exc: Exception) -> None:
    """One warning a minute per process: during an outage every request fails to count."""
    now = time.monotonic()
    if now - _last_failure_log[0] >= COUNT_FAILURE_LOG_INTERVAL_S:
        _last_failure_log[0] = now
        log.warning("could not count a /v1 request for /metrics: %r", exc)


def _label(value) -> str:
    return str(value).replace("\\", "\\\\").replace('"', '\\"').replace("\n", " ")


def _metric_name(name: str) -> str:
    return "tessera_engine_" + re.sub(r"[^a-zA-Z0-9_]", "_", name)


def engine_lines(workers: list[dict]) -> list[str]:
    lines = [
        "# HELP tessera_engine_up 1 for every engine worker with a fresh heartbeat.",
        "# TYPE tessera_engine_up gauge",
    ]
    series: dict[str, list[str]] = {}
    for worker in workers:
        labels = f'worker="{_label(worker["worker_id"])}",model="{_label(worker.get("model", ""))}"'
        lines.append(f"tessera_engine_up{{{labels}}} 1")
        for name, value in sorted((worker.get("stats") or {}).items()):
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            series.setdefault(_metric_name(name), []).append(f"{_metric_name(name)}{{{labels}}} {value}")
    lines.append(f"tessera_engine_workers {len(workers)}")
    for name, samples in sorted(series.items()):
        kind = "counter" if name.endswith("_total") and name not in GAUGES_NAMED_TOTAL else "gauge"
        lines.append(f"# TYPE {name} {kind}")
        lines.extend(samples)
    return lines


def http_lines() -> list[str]:
    r = engine.redis_client()
    counts = {k.decode(): int(v) for k, v in r.hgetall(HTTP_REQUESTS_KEY).items()}
    seconds = {k.decode(): float(v) for k, v in r.hgetall(HTTP_SECONDS_KEY).items()}
    lines = ["# HELP tessera_http_requests_total /v1 HTTP requests by route, method and status.",
             "# TYPE tessera_http_requests_total counter"]
    for key, count in sorted(counts.items()):
        route, method, status = key.split("|")
        lines.append(f'tessera_http_requests_total{{route="{_label(route)}",method="{method}",status="{status}"}} {count}')
    lines += ["# HELP tessera_http_request_seconds_sum Time spent answering /v1 requests (to the first byte for streams).",
              "# TYPE tessera_http_request_seconds_sum counter"]
    for key, total in sorted(seconds.items()):
        route, method = key.split("|")
        lines.append(f'tessera_http_request_seconds_sum{{route="{_label(route)}",method="{method}"}} {total:.6f}')
    return lines


def render() -> str:
    lines = engine_lines(engine.workers()) + http_lines()
    for collect in EXTRA_COLLECTORS:
        lines.extend(collect())
    return "\n".join(lines) + "\n"
