"""The openai-agents SDK runs an agent with one function tool over Tessera's Responses API."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tests.compat.venvs import client_venv, installed_version

pytestmark = pytest.mark.compat

REQUIREMENTS = ["openai-agents==0.24.0"]
SCRIPT = Path(__file__).with_name("agents_run.py")
WEATHER = "sunny and 23 degrees"  # what agents_run.py's get_weather answers


@pytest.fixture(scope="module")
def agents_python():
    return client_venv("openai-agents", REQUIREMENTS) / "python"


def run_agent(python: Path, tessera, *mode: str) -> dict:
    argv = [str(python), str(SCRIPT), tessera.base_url + "/v1", tessera.api_key, tessera.chat_model, *mode]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.splitlines()[-1])


@pytest.mark.parametrize("mode", [(), ("stream",)], ids=["run", "run_streamed"])
def test_an_agent_calls_its_function_tool_and_answers_after_its_result(agents_python, tessera, compat_report, mode):
    version = installed_version(agents_python.parent, "openai-agents")
    run = run_agent(agents_python, tessera, *mode)
    # The round trip the protocol guarantees: a function_call item, the tool run by the SDK, its output
    # sent back as a function_call_output item, then a message: two Responses calls, each with usage.
    assert run["items"][:2] == ["tool_call_item", "tool_call_output_item"], run
    assert run["items"][-1] == "message_output_item" and run["final_output"].strip(), run
    assert len(run["calls"]) >= 1 and all(WEATHER in output for output in run["tool_outputs"]), run
    assert run["model_calls"] >= 2 and all(i > 0 and o > 0 for i, o in run["usage"]), run
    assert all(rid.startswith("resp_") for rid in run["response_ids"]), run
    if mode:
        assert "raw_response_event" in run["stream_event_types"], run
    quoted = "quotes the tool's result" if WEATHER in run["final_output"] else "does not quote the tool's result"
    compat_report(
        "openai-agents",
        version,
        f"Runner.{'run_streamed' if mode else 'run'}: agent with one function tool (Responses API)",
        f"passed: tool called with {run['calls']}, output sent back, {run['model_calls']} model calls, "
        f"final answer {quoted}",
    )
