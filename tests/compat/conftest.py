"""The compatibility runs (`make compat`, marker `compat`): clients people put in front of an
OpenAI-compatible server, each installed into its own virtualenv under var/compat/ (never .venv),
against Tessera's real stack as `make run` starts it (the default SmolLM2 GGUF chat model and the
bundled all-MiniLM-L6-v2 embedding model).

Each check records what it tried with the `compat_report` fixture; at the end of the run the table
is printed and written to var/compat-report.md (docs/openai_api.md's "Compatibility runs" comes from it).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from openai import OpenAI

from inference.embedding_models import BUNDLED_NAME
from tests.platform.run_stack import RunStack, make_run_env
from tests.run_report import write_report

REPO = Path(__file__).resolve().parents[2]
REPORT = REPO / "var" / "compat-report.md"
_ROWS: list[tuple[str, str, str, str]] = []


@dataclass
class Tessera:
    base_url: str
    api_key: str
    chat_model: str
    embedding_model: str


@pytest.fixture(scope="session")
def tessera(tmp_path_factory):
    """`make run`'s stack on a free port: chat (SmolLM2) and embeddings (MiniLM), an admin API key."""
    var_dir = tmp_path_factory.mktemp("compat-stack")
    # Agents and LiteLLM send tool definitions and instructions: room for them, as make run's defaults give.
    engine_args = {"num_kv_blocks": 256, "max_model_len": 2048, "device": "cpu"}
    env = make_run_env("", var_dir / "var", EMBEDDING_MODEL="", ENGINE_ARGS=json.dumps(engine_args))
    stack = RunStack.start(env, var_dir / "run.log")
    try:
        _, api_key = stack.admin_login()
        client = OpenAI(base_url=stack.base_url + "/v1", api_key=api_key, max_retries=0)
        models = _wait_for_two_models(client, stack)
        embedding_model = next(m for m in models if m == BUNDLED_NAME)
        chat_model = next(m for m in models if m != embedding_model)
        yield Tessera(stack.base_url, api_key, chat_model, embedding_model)
    finally:
        stack.close()


def _wait_for_two_models(client: OpenAI, stack: RunStack, timeout: float = 300.0) -> list[str]:
    """/health is green once the chat worker is up; the embedding worker's model follows its heartbeat."""
    deadline = time.monotonic() + timeout
    while len(models := [m.id for m in client.models.list()]) < 2:
        assert time.monotonic() < deadline, stack.output()[-4000:]
        time.sleep(0.5)
    return models


@pytest.fixture
def compat_report(request):
    """record(client, version, tried, outcome): one row of the table printed at the end."""

    def record(client: str, version: str, tried: str, outcome: str) -> None:
        _ROWS.append((client, version, tried, outcome))

    return record


def pytest_terminal_summary(terminalreporter):
    write_report(
        terminalreporter,
        section="compat: clients against Tessera",
        headers=["client", "version", "tried", "outcome"],
        rows=_ROWS,
        path=REPORT,
    )
