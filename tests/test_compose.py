"""compose.yaml and the Dockerfile: valid, complete, and every command is a real project entry point."""

import importlib.util
import os
import shutil
import subprocess
import tomllib
from dataclasses import replace
from pathlib import Path

import pytest
import yaml
from django.core.management import get_commands

REPO = Path(__file__).resolve().parents[1]
COMPOSE = yaml.safe_load((REPO / "compose.yaml").read_text())
SERVICES = COMPOSE["services"]
APP_SERVICES = ("migrate", "web", "engine", "embed", "worker", "beat")


def _module_exists(name: str) -> bool:
    return importlib.util.find_spec(name) is not None


def check_entry_point(argv: list[str]) -> None:
    """Fail unless argv runs something this project (or Django/Celery on it) really provides."""
    if argv[:2] == ["python", "manage.py"]:
        assert argv[2] in get_commands(), f"no management command {argv[2]!r}"
    elif argv[:2] == ["python", "-m"]:
        assert _module_exists(argv[2]), f"no module {argv[2]}"
        if argv[2] == "tessera.healthcheck":
            from tessera.healthcheck import CHECKS

            assert argv[3] in CHECKS
        if argv[2] == "tessera.web":
            from tessera.web import parse_args

            parse_args(argv[3:])  # argparse exits on an option it does not know
    elif argv[0] == "celery":
        assert argv[1:3] == ["-A", "tessera"] and _module_exists("tessera.celery")
        assert argv[3] in ("worker", "beat", "inspect")
    else:
        pytest.fail(f"unknown entry point {argv}")


def test_the_production_services_exist():
    assert {"postgres", "redis", "migrate", "web", "engine", "embed", "worker", "beat"} <= set(SERVICES)
    assert SERVICES["postgres"]["image"].startswith("postgres:")
    assert SERVICES["redis"]["image"].startswith("redis:")


@pytest.mark.parametrize("name", APP_SERVICES)
def test_app_services_run_real_entry_points_of_one_image(name):
    service = SERVICES[name]
    assert service["build"] == "." and (REPO / "Dockerfile").exists()
    check_entry_point(service["command"])
    test = service.get("healthcheck", {}).get("test")
    if test and test[0] == "CMD":
        check_entry_point(test[1:])
    elif test:
        check_entry_point(test[1].split())


@pytest.mark.parametrize("name", ["postgres", "redis", "web", "engine", "embed", "worker"])
def test_long_running_services_have_health_checks(name):
    assert SERVICES[name]["healthcheck"]["test"]


def test_settings_come_from_the_environment_with_production_settings():
    env = SERVICES["web"]["environment"]
    assert env["DJANGO_SETTINGS_MODULE"] == "tessera.settings.prod" and _module_exists("tessera.settings.prod")
    assert env["SECRET_KEY"].startswith("${SECRET_KEY:?"), "SECRET_KEY must be required, never defaulted"
    for var in ("DATABASE_URL", "REDIS_URL", "ALLOWED_HOSTS", "CSRF_TRUSTED_ORIGINS", "MODEL"):
        assert var in env
    assert env["DATABASE_URL"].startswith("postgres://") and "@postgres:" in env["DATABASE_URL"]
    assert env["REDIS_URL"] == "redis://redis:6379/0"


def test_engine_reserves_a_gpu_and_reads_the_model_from_a_volume():
    engine = SERVICES["engine"]
    [device] = engine["deploy"]["resources"]["reservations"]["devices"]
    assert device["driver"] == "nvidia" and "gpu" in device["capabilities"]
    assert any(v.endswith(":/models:ro") for v in engine["volumes"])
    assert engine["environment"]["MODEL"].startswith("/models/")
    assert engine["environment"]["ENGINE_WORKER_ID"]  # its health check looks for this heartbeat


def test_the_embedding_worker_is_make_runs_embed_worker_on_a_model_volume():
    from inference.embedding_models import BUNDLED_NAME, EmbeddingModel
    from tessera.run import RunConfig, embedding_command

    embed, engine = SERVICES["embed"], SERVICES["engine"]
    assert embed["image"] == engine["image"] and embed["build"] == engine["build"]
    assert any(v.endswith(":/models:ro") for v in embed["volumes"])
    # make run's own command line for its "embed" worker, on the folder and name compose reads from its env.
    model = EmbeddingModel(
        f"/models/${{EMBEDDING_MODEL_NAME:-{BUNDLED_NAME}}}", f"${{EMBEDDING_SERVED_MODEL_NAME:-{BUNDLED_NAME}}}"
    )
    cfg = replace(RunConfig.from_env({"EMBEDDING_MODEL": "off"}), embedding=model)
    [make_run_argv] = embedding_command(cfg).values()
    assert embed["command"] == ["python", "manage.py", *make_run_argv[2:]]
    env = embed["environment"]
    assert env["ENGINE_WORKER_ID"] and env["ENGINE_WORKER_ID"] != engine["environment"]["ENGINE_WORKER_ID"]
    # Its engine arguments are its own, never the chat model's (as make run's embedding_env).
    assert env["ENGINE_ARGS"] == "${EMBEDDING_ENGINE_ARGS:-}" and "ENGINE_SPECULATIVE_CONFIG" not in env
    assert env["REDIS_URL"] == "redis://redis:6379/0" and "deploy" not in embed  # no GPU reserved
    assert embed["depends_on"]["redis"]["condition"] == "service_healthy"


def test_web_and_workers_wait_for_migrations_and_their_backends():
    for name in ("web", "engine", "embed", "worker", "beat"):
        depends = SERVICES[name]["depends_on"]
        assert depends["migrate"]["condition"] == "service_completed_successfully"
        assert depends["postgres"]["condition"] == depends["redis"]["condition"] == "service_healthy"


def test_the_image_collects_static_files_and_installs_the_postgres_driver():
    dockerfile = (REPO / "Dockerfile").read_text()
    assert "collectstatic --noinput" in dockerfile
    assert "DJANGO_SETTINGS_MODULE=tessera.settings.prod" in dockerfile
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert ".[postgres]" in dockerfile and any(d.startswith("psycopg") for d in extras["postgres"])
    # The same front-end assets `make assets` installs, from the npm registry at build time.
    assert "npm ci" in dockerfile and (REPO / "package-lock.json").exists()


@pytest.mark.skipif(
    not shutil.which("docker") or subprocess.run(["docker", "compose", "version"], capture_output=True).returncode != 0,
    reason="docker compose is not installed here",
)
def test_docker_compose_accepts_the_file():
    env = {**os.environ, "SECRET_KEY": "x", "POSTGRES_PASSWORD": "y", "MODEL_NAME": "m"}
    result = subprocess.run(
        ["docker", "compose", "-f", str(REPO / "compose.yaml"), "config", "--quiet"],
        env=env,
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr
