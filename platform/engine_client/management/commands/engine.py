"""`python manage.py engine`: load the model once, then serve engine requests from Redis forever.

Engine arguments (inference EngineArgs names), later sources win:
  settings.ENGINE_ARGS (dict) < env ENGINE_ARGS (JSON object) < env ENGINE_<NAME> (e.g.
  ENGINE_MAX_NUM_SEQS=64, values parsed as JSON when they parse) < --arg NAME=VALUE.
The model folder is settings.MODEL (env MODEL) unless --model is given. The worker serves its
served_model_name (engine arg, else settings.SERVED_MODEL_NAME, else the folder's name) and any
aliases (--alias, repeatable, or ENGINE_SERVED_MODEL_ALIASES=a,b): it reads only those names'
request streams. SIGTERM/SIGINT drain the
in-flight requests (ENGINE_DRAIN_TIMEOUT seconds) and exit; a second signal exits at once.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Callable

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError


def _parse_value(raw: str):
    try:
        return json.loads(raw)
    except json.JSONDecodeError:
        return raw


def engine_args_from_env(names: set[str], env=os.environ, base: dict | None = None) -> dict:
    """Merge settings.ENGINE_ARGS, env ENGINE_ARGS and ENGINE_<NAME> variables (in that order)."""
    args = dict(base or {})
    if env.get("ENGINE_ARGS"):
        loaded = json.loads(env["ENGINE_ARGS"])
        if not isinstance(loaded, dict):
            raise CommandError("ENGINE_ARGS must be a JSON object")
        args.update(loaded)
    for name in names:
        key = f"ENGINE_{name.upper()}"
        if key in env:
            args[name] = _parse_value(env[key])
    unknown = set(args) - names
    if unknown:
        raise CommandError(f"unknown engine arguments: {', '.join(sorted(unknown))}")
    return args


def _names(raw: str) -> tuple[str, ...]:
    return tuple(name.strip() for name in raw.split(",") if name.strip())


def worker_config_from_env(env=os.environ) -> dict:
    """Worker knobs (heartbeat, drain, output stream limits) from WORKER_* / ENGINE_* env vars."""
    spec: dict[str, tuple[str, Callable[[str], object]]] = {
        "heartbeat_interval": ("ENGINE_HEARTBEAT_INTERVAL", float),
        "heartbeat_ttl": ("ENGINE_HEARTBEAT_TTL", float),
        "drain_timeout": ("ENGINE_DRAIN_TIMEOUT", float),
        "max_inflight": ("ENGINE_MAX_INFLIGHT", int),
        "output_ttl": ("ENGINE_OUTPUT_TTL", int),
        "stream_interval": ("ENGINE_STREAM_INTERVAL", int),
        "worker_id": ("ENGINE_WORKER_ID", str),
        "aliases": ("ENGINE_SERVED_MODEL_ALIASES", _names),
    }
    return {field: cast(env[var]) for field, (var, cast) in spec.items() if env.get(var)}


class Command(BaseCommand):
    help = "Run an engine worker: load the model, then serve requests from Redis until SIGTERM."

    def add_arguments(self, parser):
        parser.add_argument("--model", help="HF model folder (default: settings.MODEL)")
        parser.add_argument(
            "--arg",
            action="append",
            default=[],
            metavar="NAME=VALUE",
            help="an engine argument, e.g. --arg max_num_seqs=64 (repeatable)",
        )
        parser.add_argument(
            "--alias",
            action="append",
            default=[],
            metavar="NAME",
            help="another name this model is served under (repeatable)",
        )
        parser.add_argument("--worker-id", help="consumer name in the Redis group (default: host-pid-random)")

    def handle(self, *args, **options):
        from common import connections
        from inference.config import EngineArgs
        from inference.worker import EngineWorker, WorkerConfig

        model = options["model"] or settings.MODEL
        engine_args = engine_args_from_env(EngineArgs.names(), base=getattr(settings, "ENGINE_ARGS", {}))
        for item in options["arg"]:
            name, _, value = item.partition("=")
            if name not in EngineArgs.names():
                raise CommandError(f"unknown engine argument {name!r}")
            engine_args[name] = _parse_value(value)
        engine_args.pop("model", None)
        llm = self.load(model, engine_args)
        worker = self.build_worker(
            llm, model, engine_args, options, connections.sync_redis(), EngineWorker, WorkerConfig
        )
        self.install_signal_handlers(worker)
        where = settings.REDIS_URL.rsplit("@", 1)[-1]  # host:port/db, never the URL's password
        self.stdout.write(f"engine worker {worker.worker_id} ready on redis {where}", ending="\n")
        self.stdout.flush()
        worker.run()

    def load(self, model: str, engine_args: dict):
        """Load the model with a visible progress line (the loader adds its own per-file progress)."""
        from inference import LLM

        self.stdout.write(f"loading {model} with {json.dumps(engine_args, sort_keys=True)} ...")
        self.stdout.flush()
        started = time.monotonic()
        try:
            llm = LLM(model=model, **engine_args)
        except (FileNotFoundError, ValueError) as exc:
            raise CommandError(f"cannot load {model}: {exc}") from exc
        self.stdout.write(self.style.SUCCESS(f"model loaded in {time.monotonic() - started:.1f}s"))
        return llm

    def build_worker(self, llm, model, engine_args, options, client, worker_cls, config_cls):
        engine = llm.llm_engine
        served = (
            engine_args.get("served_model_name")
            or getattr(settings, "SERVED_MODEL_NAME", "")
            or os.path.basename(os.path.normpath(model))
        )
        info = {
            "engine_args": engine_args,
            "model_path": model,
            "max_model_len": _max_model_len(engine),
            "memory": getattr(engine, "memory", None),
        }
        info.update(getattr(engine, "served_info", dict)())  # an embedding model: its task and sizes
        config = config_cls(model_name=served, extra_info=info, freeze_heap=True, **worker_config_from_env())
        if options.get("alias"):
            config.aliases = tuple(options["alias"])
        if options.get("worker_id"):
            config.worker_id = options["worker_id"]
        return worker_cls(engine, client, config)

    def install_signal_handlers(self, worker) -> None:
        def on_signal(signum, _frame):
            first = not worker._draining
            worker.stop(drain=first)
            self.stderr.write(f"signal {signum}: {'draining in-flight requests' if first else 'stopping now'}")

        signal.signal(signal.SIGTERM, on_signal)
        signal.signal(signal.SIGINT, on_signal)


def _max_model_len(engine) -> int | None:
    if isinstance(getattr(engine, "max_model_len", None), int):
        return engine.max_model_len
    for holder in (
        getattr(engine, "args", None),
        getattr(engine, "engine_args", None),
        getattr(engine, "config", None),
    ):
        value = getattr(holder, "max_model_len", None)
        if isinstance(value, int):
            return value
    return None
