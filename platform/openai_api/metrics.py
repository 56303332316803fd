"""GET /metrics, rendered by prometheus-client: vLLM's engine metrics (`vllm:*`, label model_name and
worker) and tessera's engine gauges from every worker's heartbeat, plus the /v1 HTTP counters.

Every web replica reads the same Redis: the engine series are the same on all of them, and the HTTP
counters are kept in Redis per replica (label replica), so one replica's scrape holds everything
(docs/metrics.md: scrape one replica, or dedupe). Other apps add lines by appending a callable to
EXTRA_COLLECTORS (each returns a list of lines).
"""

from __future__ import annotations

import logging
import os
import re
import socket
import time
from collections.abc import Callable

from django.urls import Resolver404, resolve
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, SummaryMetricFamily
from prometheus_client.utils import floatToGoString

from common import connections, http_guards
from engine_client import client as engine
from inference.metrics import cumulative

log = logging.getLogger("tessera.api")

HTTP_REQUESTS_KEY = "tessera:http:requests"
HTTP_SECONDS_KEY = "tessera:http:seconds"
EXTRA_COLLECTORS: list[Callable[[], list[str]]] = []
GAUGES_NAMED_TOTAL = {"tessera_engine_blocks_total"}  # a size, not a running count
COUNT_FAILURE_LOG_INTERVAL_S = 60.0
# This web replica's name in the HTTP counters (the compose service's container host name by default).
REPLICA = os.environ.get("TESSERA_REPLICA") or socket.gethostname()

# The heartbeat's names -> vLLM's (the names vLLM 0.x's Grafana dashboard reads) and vLLM's help texts.
VLLM_HISTOGRAMS = {
    "time_to_first_token_seconds": ("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds."),
    "time_per_output_token_seconds": (
        "vllm:time_per_output_token_seconds",
        "Histogram of time per output token in seconds.",
    ),
    "e2e_request_latency_seconds": (
        "vllm:e2e_request_latency_seconds",
        "Histogram of end to end request latency in seconds.",
    ),
    "request_queue_time_seconds": (
        "vllm:request_queue_time_seconds",
        "Histogram of time spent in WAITING phase for request.",
    ),
}
VLLM_GAUGES = {
    "num_running": ("vllm:num_requests_running", "Number of requests in model execution batches."),
    "num_waiting": ("vllm:num_requests_waiting", "Number of requests waiting to be processed."),
    "kv_usage": ("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage."),
}
VLLM_COUNTERS = {
    "prompt_tokens_total": ("vllm:prompt_tokens", "Number of prefill tokens processed."),
    "generation_tokens_total": ("vllm:generation_tokens", "Number of generation tokens processed."),
    "num_preemptions": ("vllm:num_preemptions", "Cumulative number of preemption from the engine."),
    "spec_decode_num_drafts_total": ("vllm:spec_decode_num_drafts", "Number of spec decoding drafts."),
    "spec_decode_num_draft_tokens_total": ("vllm:spec_decode_num_draft_tokens", "Number of draft tokens."),
    "spec_decode_num_accepted_tokens_total": ("vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens."),
}
VLLM_LABELS = ["model_name", "worker"]


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
    pipe.hincrby(HTTP_REQUESTS_KEY, f"{REPLICA}|{route}|{method}|{status}", 1)
    pipe.hincrbyfloat(HTTP_SECONDS_KEY, f"{REPLICA}|{route}|{method}", seconds)
    return pipe


def count_request(request, status: int, seconds: float) -> None:
    try:
        _count_ops(connections.sync_redis().pipeline(transaction=False), request, status, seconds).execute()
    except Exception as exc:  # counting must never replace the answer it counts
        _log_count_failure(exc)


async def acount_request(request, status: int, seconds: float) -> None:
    """count_request on the event loop (no thread hop before a stream's first byte)."""
    try:
        await _count_ops(connections.async_redis().pipeline(transaction=False), request, status, seconds).execute()
    except Exception as exc:
        _log_count_failure(exc)


_last_failure_log = [float("-inf")]


def _log_count_failure(exc: Exception) -> None:
    """One warning a minute per process: during an outage every request fails to count."""
    now = time.monotonic()
    if now - _last_failure_log[0] >= COUNT_FAILURE_LOG_INTERVAL_S:
        _last_failure_log[0] = now
        log.warning("could not count a /v1 request for /metrics: %r", exc)


def _metric_name(name: str) -> str:
    return "tessera_engine_" + re.sub(r"[^a-zA-Z0-9_]", "_", name)


class HeartbeatCollector:
    """The engine families of the given heartbeats (protocol.Heartbeat.as_dict()), one series per worker."""

    def __init__(self, workers: list[dict]):
        self.workers = workers

    def collect(self):
        yield from self._vllm_families()
        yield from self._tessera_families()

    def _vllm_families(self):
        histograms = {
            key: HistogramMetricFamily(name, doc, labels=VLLM_LABELS) for key, (name, doc) in VLLM_HISTOGRAMS.items()
        }
        gauges = {key: GaugeMetricFamily(name, doc, labels=VLLM_LABELS) for key, (name, doc) in VLLM_GAUGES.items()}
        counters = {
            key: CounterMetricFamily(name, doc, labels=VLLM_LABELS) for key, (name, doc) in VLLM_COUNTERS.items()
        }
        success = CounterMetricFamily(
            "vllm:request_success",
            "Count of successfully processed requests.",
            labels=[*VLLM_LABELS, "finished_reason"],
        )
        for worker in self.workers:
            labels = [worker.get("model", ""), worker["worker_id"]]
            stats = worker.get("stats") or {}
            for key, family in [*gauges.items(), *counters.items()]:
                if _is_number(stats.get(key)):
                    family.add_metric(labels, stats[key])
            engine_metrics = stats.get("engine_metrics") or {}  # absent from workers older than it
            for reason, count in sorted((engine_metrics.get("request_success_total") or {}).items()):
                success.add_metric([*labels, reason], count)
            for key, histogram in (engine_metrics.get("histograms") or {}).items():
                if key in histograms:
                    buckets = [(floatToGoString(bound), count) for bound, count in cumulative(histogram)]
                    histograms[key].add_metric(labels, buckets, histogram["sum"])
        yield from histograms.values()
        yield from gauges.values()
        yield from counters.values()
        yield success
        yield self._accepted_per_position()

    def _accepted_per_position(self) -> CounterMetricFamily:
        """vLLM's per-position acceptance: how often the draft's i-th token was accepted."""
        family = CounterMetricFamily(
            "vllm:spec_decode_num_accepted_tokens_per_pos",
            "Accepted tokens per draft position.",
            labels=[*VLLM_LABELS, "position"],
        )
        for worker in self.workers:
            labels = [worker.get("model", ""), worker["worker_id"]]
            per_position = (worker.get("stats") or {}).get("spec_decode_num_accepted_tokens_per_pos") or []
            for position, count in enumerate(per_position):
                family.add_metric([*labels, str(position)], count)
        return family

    def _tessera_families(self):
        up = GaugeMetricFamily(
            "tessera_engine_up", "1 for every engine worker with a fresh heartbeat.", labels=["worker", "model"]
        )
        families: dict[str, GaugeMetricFamily | CounterMetricFamily] = {}
        for worker in self.workers:
            labels = [worker["worker_id"], worker.get("model", "")]
            up.add_metric(labels, 1)
            for key, value in sorted((worker.get("stats") or {}).items()):
                if _is_number(value):
                    name = _metric_name(key)
                    if name not in families:
                        kind = (
                            CounterMetricFamily
                            if name.endswith("_total") and name not in GAUGES_NAMED_TOTAL
                            else GaugeMetricFamily
                        )
                        families[name] = kind(name, f"The heartbeat's {key}.", labels=["worker", "model"])
                    families[name].add_metric(labels, value)
        yield up
        yield GaugeMetricFamily(
            "tessera_engine_workers", "Engine workers with a fresh heartbeat.", value=len(self.workers)
        )
        yield from (families[name] for name in sorted(families))
        yield from self._tenant_share_families()

    def _tenant_share_families(self):
        """Each worker's top tenants by share of the last minute's service, the rest as tenant "others":
        at most six series per worker, however many users there are."""
        labels = ["worker", "model", "tenant"]
        share = GaugeMetricFamily(
            "tessera_engine_tenant_share",
            "A tenant's share of the last minute's served tokens (prompt x1 + output x2).",
            labels=labels,
        )
        weight = GaugeMetricFamily("tessera_engine_tenant_weight", "A tenant's fair share weight.", labels=labels)
        for worker in self.workers:
            shares = (worker.get("stats") or {}).get("tenant_shares") or {}
            base = [worker["worker_id"], worker.get("model", "")]
            for row in shares.get("tenants") or []:
                share.add_metric([*base, str(row["tenant"])], row["share"])
                weight.add_metric([*base, str(row["tenant"])], row["weight"])
            if shares.get("others", {}).get("tokens"):
                share.add_metric([*base, "others"], shares["others"]["share"])
        yield share
        yield weight


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


class HttpCollector:
    """The /v1 HTTP counters of every web replica, as counted in Redis."""

    def __init__(self, r):
        self.r = r

    def collect(self):
        requests, seconds = self._read()
        total = CounterMetricFamily(
            "tessera_http_requests",
            "/v1 HTTP requests by route, method and status.",
            labels=["route", "method", "status", "replica"],
        )
        answered = SummaryMetricFamily(
            "tessera_http_request_seconds",
            "Time spent answering /v1 requests (to the first byte for streams).",
            labels=["route", "method", "replica"],
        )
        counts_by_route: dict[tuple[str, str, str], int] = {}
        for (replica, route, method, status), count in sorted(requests.items()):
            total.add_metric([route, method, status, replica], count)
            counts_by_route[(route, method, replica)] = counts_by_route.get((route, method, replica), 0) + count
        for (replica, route, method), spent in sorted(seconds.items()):
            answered.add_metric([route, method, replica], counts_by_route.get((route, method, replica), 0), spent)
        yield total
        yield answered

    def _read(self) -> tuple[dict, dict]:
        pipe = self.r.pipeline(transaction=True)  # counts and seconds of the same moment
        raw_requests, raw_seconds = pipe.hgetall(HTTP_REQUESTS_KEY).hgetall(HTTP_SECONDS_KEY).execute()
        requests = {tuple(k.decode().split("|")): int(v) for k, v in raw_requests.items()}
        seconds = {tuple(k.decode().split("|")): float(v) for k, v in raw_seconds.items()}
        # fields without a replica are from before it was counted: left out, never mislabelled
        return ({k: v for k, v in requests.items() if len(k) == 4}, {k: v for k, v in seconds.items() if len(k) == 3})


def render() -> str:
    registry = CollectorRegistry(auto_describe=False)  # one per scrape: no process-global state
    registry.register(HeartbeatCollector(engine.workers()))
    registry.register(HttpCollector(connections.sync_redis()))
    lines = [generate_latest(registry).decode().rstrip("\n")]
    for collect in EXTRA_COLLECTORS:
        lines.extend(collect())
    return "\n".join(lines) + "\n"
