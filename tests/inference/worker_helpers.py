"""Helpers for the engine-worker protocol tests: a tiny engine and a worker running in a thread."""

from __future__ import annotations

import threading
import time

import pytest
import redis
from django.conf import settings

from inference import LLM, protocol
from inference.worker import EngineWorker, WorkerConfig

MODEL = "tiny"  # the name ThreadedWorker serves by default (requests are routed by it)
ENGINE_ARGS = dict(
    dtype="float32",
    device="cpu",
    block_size=16,
    max_num_seqs=8,
    max_num_batched_tokens=512,
    max_model_len=256,
    num_kv_blocks=64,
    seed=0,
)


def tiny_llm(model_dir: str) -> LLM:
    return LLM(model=model_dir, **ENGINE_ARGS)


def clear_engine_keys(client: redis.Redis) -> None:
    keys = list(client.scan_iter("tessera:engine:*", count=1000))
    if keys:
        client.delete(*keys)


class ThreadedWorker:
    """An EngineWorker whose loop runs in a thread; crash() stops it without any clean-up."""

    def __init__(self, engine, redis_url: str, **config):
        defaults = dict(
            heartbeat_interval=0.2,
            heartbeat_ttl=1.0,
            reap_interval=0.3,
            model_name=MODEL,
            extra_info={"max_model_len": engine.max_model_len},
        )
        defaults.update(config)
        self.worker = EngineWorker(engine, redis.Redis.from_url(redis_url), WorkerConfig(**defaults))
        self._crash = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        self.worker.setup()
        try:
            while not self._crash.is_set() and not self.worker._stopping.is_set():
                if self.worker._draining and not self.worker.states:
                    break
                self.worker.run_once()
        finally:
            if not self._crash.is_set():
                self.worker.shutdown()

    def start(self) -> "ThreadedWorker":
        self.thread.start()
        return self

    def stop(self) -> None:
        self.worker.stop(drain=False)
        self.thread.join(10)

    def crash(self) -> None:
        """Die like a killed process: no more steps, no heartbeats, nothing cleaned up."""
        self._crash.set()
        self.thread.join(10)
        self.worker._stopping.set()  # the heartbeat thread stops too; the key then expires
        self.worker.engine.abort_request(list(self.worker.states))  # free the shared engine for later tests
        while self.worker.engine.has_unfinished_requests():
            self.worker.engine.step()


def serving_worker(llm: LLM, model_name: str, max_model_len: int) -> "ThreadedWorker":
    """A worker thread serving model_name on the test Redis (its engine keys cleared first), once its
    heartbeat is up: the /v1 admission then sees the model and its context length."""
    r = redis.Redis.from_url(settings.REDIS_URL)
    clear_engine_keys(r)
    worker = ThreadedWorker(
        llm.llm_engine,
        settings.REDIS_URL,
        model_name=model_name,
        extra_info={"max_model_len": max_model_len, "model_path": llm.llm_engine.args.model},
    ).start()
    wait_for(lambda: r.exists(protocol.heartbeat_key(worker.worker.worker_id)))
    return worker


def wait_for(predicate, timeout: float = 10.0, interval: float = 0.05):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"condition not met within {timeout}s")


# Fixtures shared by the worker-protocol and engine-client tests (import them by name).


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    return tiny_llm(tiny_model_dir)


@pytest.fixture
def r():
    client = redis.Redis.from_url(settings.REDIS_URL)
    clear_engine_keys(client)
    yield client
    clear_engine_keys(client)


@pytest.fixture
def worker(llm, r):
    from engine_client import client as engine_client

    running = ThreadedWorker(llm.llm_engine, settings.REDIS_URL).start()
    wait_for(lambda: engine_client.client().health()["ok"])
    yield running
    running.stop()
