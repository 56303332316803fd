"""Which models the live engine workers serve, and where each one's tokenizer lives.

Requests are routed by model name (docs/protocol.md), so every front door builds a prompt with
the tokenizer of the model that will run it and refuses a name nobody serves.
"""

from __future__ import annotations

import os

from django.conf import settings

from engine_client import client as engine
from errors import EngineUnavailable, NotFound

WORKERS_MAX_AGE_S = 1.0


def configured_model_name() -> str:
    return getattr(settings, "SERVED_MODEL_NAME", "") or os.path.basename(os.path.normpath(str(settings.MODEL)))


def models_from_workers(workers: list[dict]) -> dict[str, dict]:
    """served name -> {"max_model_len", "model_path", "created", "task", "pooling"} from live heartbeats,
    aliases included."""
    models = {}
    for worker in workers:
        config = worker.get("config") or {}
        for name in worker.get("served_model_names") or [worker.get("model")]:
            if name and name not in models:
                models[name] = {
                    "max_model_len": config.get("max_model_len"),
                    "model_path": config.get("model_path") or str(settings.MODEL),
                    "created": int(worker.get("started_at", 0)),
                    "task": config.get("task") or "generate",  # "embed": an encoder's embeddings
                    "pooling": config.get("pooling"),
                }  # an embedding model's sizes
    return models


async def served_models() -> dict[str, dict]:
    """What /v1/models lists: the names live workers serve right now."""
    return models_from_workers(await engine.aclient().workers())


def known_models() -> dict[str, dict]:
    """The live workers' models plus the configured one, which work may wait for (batches, the
    playground's menu); Redis being away leaves the configured model."""
    try:
        models = models_from_workers(engine.client().workers(max_age=WORKERS_MAX_AGE_S))
    except Exception:
        models = {}
    models.setdefault(configured_model_name(), {"max_model_len": None, "model_path": str(settings.MODEL), "created": 0})
    return models


def resolve_model(name: str) -> dict:
    """The live workers' facts about `name` for a request that must run now: 404 for a model no
    live worker serves (nobody else would answer it); 503 for the configured model while no worker
    at all is up (a restart, not a wrong name).

    A snapshot up to WORKERS_MAX_AGE_S old is good enough: a worker that died since then fails the
    request with worker_lost / no_worker through the stream instead of an error up front.
    """
    workers = engine.client().workers(max_age=WORKERS_MAX_AGE_S)
    models = models_from_workers(workers)
    if name in models:
        return models[name]
    if not workers and name == configured_model_name():
        raise EngineUnavailable("No engine worker is running; try again shortly.")
    raise NotFound(
        f"The model '{name}' does not exist or no engine worker is serving it.", param="model", code="model_not_found"
    )
