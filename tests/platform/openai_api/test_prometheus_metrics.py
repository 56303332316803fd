"""GET /metrics in vLLM's names: two real engine workers on tiny models serve /v1 requests on the test
Redis; the exposition, parsed by prometheus_client's own parser, must count exactly those requests."""

from __future__ import annotations

import pytest
import redis
from django.conf import settings
from django.contrib.auth.models import User
from django.test import Client
from prometheus_client.parser import text_string_to_metric_families

from accounts.services import create_api_key
from inference import LLM, protocol
from openai_api import metrics
from tests.inference.worker_helpers import ENGINE_ARGS, ThreadedWorker, clear_engine_keys, tiny_llm, wait_for

pytestmark = pytest.mark.django_db(transaction=True)
MODEL = "tiny-metrics"
MAX_TOKENS = 3
PROMPTS = [[5, 6, 7, 8], [9, 10, 11, 12], [13, 14, 15, 16], [17, 18, 19, 20], [21, 22, 23, 24]]
HISTOGRAMS = (
    "vllm:time_to_first_token_seconds",
    "vllm:time_per_output_token_seconds",
    "vllm:e2e_request_latency_seconds",
    "vllm:request_queue_time_seconds",
)
COUNTERS = ("vllm:prompt_tokens", "vllm:generation_tokens", "vllm:request_success", "vllm:num_preemptions")
GAUGES = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc")


@pytest.fixture(scope="module")
def llms(tiny_model_dir):
    return [tiny_llm(tiny_model_dir), tiny_llm(tiny_model_dir)]  # fresh engines: their counts start at zero


@pytest.fixture
def raw_key(settings):
    settings.QUOTA_DEFAULT_PLAN = {
        "tokens_per_day": 10**8,
        "tokens_per_month": 10**9,
        "requests_per_minute": 10**5,
        "concurrent_requests": 100,
        "max_tokens_per_request": 1000,
    }
    return create_api_key(User.objects.create_user("scraper", password="pw-long-enough"))[1]


@pytest.fixture
def two_workers(llms):
    r = redis.Redis.from_url(settings.REDIS_URL)
    clear_engine_keys(r)
    workers = [
        ThreadedWorker(
            llm.llm_engine,
            settings.REDIS_URL,
            model_name=MODEL,
            extra_info={"max_model_len": llm.llm_engine.max_model_len},
        ).start()
        for llm in llms
    ]
    wait_for(lambda: all(r.exists(protocol.heartbeat_key(w.worker.worker_id)) for w in workers))
    yield [w.worker.worker_id for w in workers]
    for worker in workers:
        worker.stop()
    clear_engine_keys(r)


def scrape() -> dict:
    """{family name: Metric} of GET /metrics, parsed as Prometheus would."""
    response = Client().get("/metrics")
    assert response.status_code == 200 and response["Content-Type"].startswith("text/plain; version=0.0.4")
    return {family.name: family for family in text_string_to_metric_families(response.content.decode())}


def samples(family, name: str, **labels) -> list:
    return [s for s in family.samples if s.name == name and labels.items() <= s.labels.items()]


def total(family, name: str, **labels) -> float:
    return sum(s.value for s in samples(family, name, **labels))


def scrape_once_finished(expected: int) -> dict | None:
    """A scrape whose workers' heartbeats (a moment behind the answers) have all the finished requests."""
    families = scrape()
    latency = families["vllm:e2e_request_latency_seconds"]
    return families if total(latency, "vllm:e2e_request_latency_seconds_count") == expected else None


def test_engine_histograms_and_counters_count_the_served_requests(raw_key, two_workers):
    for prompt in PROMPTS:
        response = Client().post(
            "/v1/completions",
            {"model": MODEL, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True},
            content_type="application/json",
            HTTP_AUTHORIZATION=f"Bearer {raw_key}",
        )
        assert response.status_code == 200, response.content
    families = wait_for(lambda: scrape_once_finished(len(PROMPTS)), timeout=30)

    for name in HISTOGRAMS:
        assert families[name].type == "histogram", name
        for worker in two_workers:  # one series per worker, so sum() over workers is right
            buckets = samples(families[name], name + "_bucket", worker=worker, model_name=MODEL)
            assert [s.labels["le"] for s in buckets][-1] == "+Inf"
            values = [s.value for s in buckets]
            assert values == sorted(values), (name, values)  # cumulative
            [count] = samples(families[name], name + "_count", worker=worker, model_name=MODEL)
            assert values[-1] == count.value
    for name in (
        "vllm:time_to_first_token_seconds",
        "vllm:time_per_output_token_seconds",
        "vllm:e2e_request_latency_seconds",
        "vllm:request_queue_time_seconds",
    ):
        assert total(families[name], name + "_count", model_name=MODEL) == len(PROMPTS), name
        assert total(families[name], name + "_sum", model_name=MODEL) > 0, name

    for name in COUNTERS:
        assert families[name].type == "counter", name
    assert total(families["vllm:prompt_tokens"], "vllm:prompt_tokens_total") == sum(map(len, PROMPTS))
    assert total(families["vllm:generation_tokens"], "vllm:generation_tokens_total") == len(PROMPTS) * MAX_TOKENS
    success = families["vllm:request_success"]
    assert total(success, "vllm:request_success_total", finished_reason="length", model_name=MODEL) == len(PROMPTS)
    assert {s.labels["finished_reason"] for s in success.samples} == {"length"}
    assert total(families["vllm:num_preemptions"], "vllm:num_preemptions_total") == 0

    for name in GAUGES:
        assert families[name].type == "gauge", name
        assert {s.labels["worker"] for s in families[name].samples} == set(two_workers), name
    assert all(0 <= s.value <= 1 for s in families["vllm:kv_cache_usage_perc"].samples)
    for name in (*HISTOGRAMS, *COUNTERS, *GAUGES):
        for sample in families[name].samples:
            assert sample.labels["model_name"] == MODEL and sample.labels["worker"] in two_workers, sample
    # tessera's own engine series stay beside vLLM's
    assert {s.labels["worker"] for s in families["tessera_engine_up"].samples} == set(two_workers)


@pytest.fixture
def self_drafted_worker(tiny_model_dir):
    """A worker whose model drafts for itself: every proposed token is accepted."""
    draft = {"method": "draft_model", "num_speculative_tokens": 3, "model": tiny_model_dir, "draft_cost": 0}
    llm = LLM(model=tiny_model_dir, **ENGINE_ARGS, speculative_config=draft)
    r = redis.Redis.from_url(settings.REDIS_URL)
    clear_engine_keys(r)
    worker = ThreadedWorker(llm.llm_engine, settings.REDIS_URL, model_name=MODEL).start()
    wait_for(lambda: r.exists(protocol.heartbeat_key(worker.worker.worker_id)))
    yield worker.worker.worker_id
    worker.stop()
    clear_engine_keys(r)


def scrape_once_generated(expected_tokens: int) -> dict | None:
    families = scrape()
    generated = total(families["vllm:generation_tokens"], "vllm:generation_tokens_total")
    return families if generated == expected_tokens else None


def test_speculation_counters_and_acceptance_per_position(raw_key, self_drafted_worker):
    max_tokens = 10
    for prompt in PROMPTS[:2]:
        response = Client().post(
            "/v1/completions",
            {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True},
            content_type="application/json",
            HTTP_AUTHORIZATION=f"Bearer {raw_key}",
        )
        assert response.status_code == 200, response.content
    families = wait_for(lambda: scrape_once_generated(2 * max_tokens), timeout=30)

    def count(name: str, **labels) -> float:
        return total(families[name], name + "_total", worker=self_drafted_worker, **labels)

    drafts = count("vllm:spec_decode_num_drafts")
    proposed = count("vllm:spec_decode_num_draft_tokens")
    accepted = count("vllm:spec_decode_num_accepted_tokens")
    assert drafts > 0 and accepted == proposed  # a model drafting for itself is always right
    per_position = [
        s.value
        for s in sorted(
            samples(
                families["vllm:spec_decode_num_accepted_tokens_per_pos"],
                "vllm:spec_decode_num_accepted_tokens_per_pos_total",
                worker=self_drafted_worker,
            ),
            key=lambda s: int(s.labels["position"]),
        )
    ]
    assert len(per_position) == 3 and sum(per_position) == accepted
    assert per_position == sorted(per_position, reverse=True)  # a later position is accepted only after earlier ones
    [rate] = samples(
        families["tessera_engine_spec_decode_acceptance_rate"], "tessera_engine_spec_decode_acceptance_rate"
    )
    assert rate.value == 1.0


def test_a_request_that_opts_out_is_decoded_without_speculation(raw_key, self_drafted_worker):
    def complete(**extra) -> None:
        body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 10, "temperature": 0, "ignore_eos": True}
        headers = {"HTTP_AUTHORIZATION": f"Bearer {raw_key}"}
        response = Client().post("/v1/completions", {**body, **extra}, content_type="application/json", **headers)
        assert response.status_code == 200, response.content

    def drafts(families) -> float:
        name = "vllm:spec_decode_num_drafts"
        return total(families[name], name + "_total", worker=self_drafted_worker)

    complete(speculative=False)
    assert drafts(wait_for(lambda: scrape_once_generated(10), timeout=30)) == 0
    complete()  # the same request, not opting out
    assert drafts(wait_for(lambda: scrape_once_generated(20), timeout=30)) > 0


def test_http_counters_are_labelled_by_web_replica(raw_key):
    def models_200s() -> float:
        family = scrape()["tessera_http_requests"]
        return total(
            family,
            "tessera_http_requests_total",
            route="/v1/models",
            method="GET",
            status="200",
            replica=metrics.REPLICA,
        )

    before = models_200s()
    for _ in range(3):
        assert Client().get("/v1/models", HTTP_AUTHORIZATION=f"Bearer {raw_key}").status_code == 200
    assert models_200s() == before + 3
    families = scrape()
    labels = dict(route="/v1/models", method="GET", replica=metrics.REPLICA)
    assert families["tessera_http_request_seconds"].type == "summary"
    [count] = samples(families["tessera_http_request_seconds"], "tessera_http_request_seconds_count", **labels)
    assert count.value == total(families["tessera_http_requests"], "tessera_http_requests_total", **labels)
