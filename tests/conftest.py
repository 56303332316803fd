"""Shared fixtures: tiny HF model folders built once per session.

Without a GPU, Triton kernels (tests/kernels and the engine's "triton" backend) run in Triton's
interpreter, which has to be chosen before triton.language is first imported: hence here.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from tiny_models import make_tiny_model


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A tiny random-weight Llama saved as an HF folder with tokenizer and chat template."""
    return str(make_tiny_model(tmp_path_factory.mktemp("tiny-llama"), "llama"))


@pytest.fixture(scope="session")
def model_factory(tmp_path_factory):
    """Build (and cache per session) a tiny model of a given family."""
    built = {}

    def build(family: str = "llama", **overrides):
        key = (family, tuple(sorted(overrides.items())))
        if key not in built:
            built[key] = str(make_tiny_model(tmp_path_factory.mktemp(f"tiny-{family}"), family, **overrides))
        return built[key]

    return build


@pytest.fixture(scope="session")
def django_db_setup(django_db_setup, django_db_blocker):
    """pytest-django's test database; on PostgreSQL (`make test`, tessera.embedded_postgres) the sessions
    other threads left open (sync_to_async's thread pool keeps its connections) are ended first, since
    PostgreSQL refuses to drop a database that is in use."""
    yield
    from django.db import connection

    if connection.vendor != "postgresql":
        return
    with django_db_blocker.unblock(), connection.cursor() as cursor:
        cursor.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
            " WHERE datname = current_database() AND pid <> pg_backend_pid()"
        )
