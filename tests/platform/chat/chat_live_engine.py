"""A tiny engine and a worker thread serving it over the real test Redis (for consumer and browser tests).

Each engine step is slowed to STEP_DELAY_S so that "stop" and "reconnect" happen mid-answer, as
they would with a real model, instead of racing a tiny model that finishes in milliseconds.
"""

from __future__ import annotations

import time

from inference import LLM
from tests.inference.worker_helpers import ThreadedWorker, clear_engine_keys, wait_for  # noqa: F401

STEP_DELAY_S = 0.02
ENGINE_ARGS = dict(
    dtype="float32",
    device="cpu",
    block_size=16,
    max_num_seqs=8,
    max_num_batched_tokens=1024,
    max_model_len=1024,
    num_kv_blocks=256,
    seed=0,
)


def slow_llm(model_dir: str, step_delay_s: float = STEP_DELAY_S) -> LLM:
    llm = LLM(model=model_dir, **ENGINE_ARGS)
    engine = llm.llm_engine
    step = engine.step

    def paced_step():
        outputs = step()
        if outputs:
            time.sleep(step_delay_s)
        return outputs

    engine.step = paced_step
    return llm


def start_worker(llm: LLM, redis_url: str) -> ThreadedWorker:
    return ThreadedWorker(llm.llm_engine, redis_url, model_name="tiny").start()


def session_cookie(user) -> bytes:
    """The Cookie header of a logged-in session for `user` (websocket tests authenticate with it)."""
    from django.conf import settings
    from django.test import Client

    client = Client()
    client.force_login(user)
    return f"sessionid={client.cookies[settings.SESSION_COOKIE_NAME].value}".encode()
