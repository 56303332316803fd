"""The `tessera` console script: what it says without arguments, `serve --help` generated from
EngineArgs, the flags reaching the engine worker's own argument reader, and a real start / stop of
the whole stack on the tiny model (the supervisor `make run` starts, tests/platform/run_stack.py)."""

from __future__ import annotations

import dataclasses
import signal
import subprocess
import sys
from pathlib import Path

import pytest

import tessera_cli
from engine_client.management.commands.engine import engine_args_from_env
from inference.config import EngineArgs
from tests.platform.run_stack import RunStack, alive, descendants, make_run_env

SCRIPT = Path(sys.executable).parent / "tessera"


def run_script(*args: str) -> subprocess.CompletedProcess:
    assert SCRIPT.is_file(), f"{SCRIPT} is missing: `make install` (pip install -e .) installs the console script"
    return subprocess.run([str(SCRIPT), *args], capture_output=True, text=True, timeout=120, cwd="/")


def test_without_arguments_it_says_what_it_can_do():
    done = run_script()
    assert done.returncode == 0, done.stderr
    assert "serve" in done.stdout and "start the whole stack" in done.stdout
    assert "tessera serve --help" in done.stdout


def test_serve_help_lists_every_engine_argument_as_a_flag():
    done = run_script("serve", "--help")
    assert done.returncode == 0, done.stderr
    for field in dataclasses.fields(EngineArgs):
        if field.name != "model":
            assert "--" + field.name.replace("_", "-") in done.stdout, field.name
    for flag in ("--max-model-len", "--dtype", "--tensor-parallel-size", "--scheduling-policy", "--port", "--host"):
        assert flag in done.stdout
    assert "--no-enable-prefix-caching" in done.stdout


def test_a_bad_flag_value_is_refused_before_anything_starts():
    done = run_script("serve", "--max-model-len", "lots")
    assert done.returncode == 2 and "--max-model-len: invalid int value: 'lots'" in done.stderr


def test_flags_reach_the_engine_workers_own_reader_and_unset_ones_stay_unset():
    args = tessera_cli.build_parser().parse_args(
        [
            "serve",
            "/models/x",
            "--max-model-len",
            "256",
            "--dtype",
            "float32",
            "--no-enable-prefix-caching",
            "--served-model-name",
            "123",
            "--gpu-memory-utilization",
            "0.5",
            "--port",
            "9123",
        ]
    )
    env = tessera_cli.serve_env(args, {"ENGINE_ARGS": '{"max_model_len": 64, "block_size": 32}'})
    assert (env["MODEL"], env["PORT"], env["SERVED_MODEL_NAME"]) == ("/models/x", "9123", "123")
    assert engine_args_from_env(EngineArgs.names(), env=env) == {
        "max_model_len": 256,
        "block_size": 32,
        "dtype": "float32",
        "enable_prefix_caching": False,
        "served_model_name": "123",
        "gpu_memory_utilization": 0.5,
    }


@pytest.mark.slow
def test_serve_starts_the_whole_stack_on_a_model_and_ctrl_c_stops_it(tiny_model_dir, tmp_path):
    from openai import OpenAI

    env = make_run_env("", tmp_path / "var")  # neither MODEL nor ENGINE_ARGS: the flags say it all
    del env["ENGINE_ARGS"], env["MODEL"]
    env["EMBEDDING_MODEL"] = "off"  # the chat model's worker alone
    command = [
        str(SCRIPT),
        "serve",
        tiny_model_dir,
        "--max-model-len",
        "192",
        "--num-kv-blocks",
        "64",
        "--device",
        "cpu",
        "--served-model-name",
        "tiny-served",
        "--port",
        env["PORT"],
    ]
    assert SCRIPT.is_file(), "`make install` installs the console script"
    stack = RunStack.start(env, tmp_path / "serve.log", command=command)
    try:
        _, api_key = stack.admin_login()
        client = OpenAI(base_url=stack.base_url + "/v1", api_key=api_key, max_retries=0)
        [model] = client.models.list().data
        assert (model.id, model.max_model_len) == ("tiny-served", 192)
        reply = client.responses.create(model="tiny-served", input="Hello", max_output_tokens=4, temperature=0)
        assert reply.usage.output_tokens >= 1

        children = descendants(stack.process.pid)
        assert len(children) >= 5
        stack.process.send_signal(signal.SIGINT)  # what Ctrl-C in the terminal delivers
        assert stack.process.wait(90) == 0
        assert "stopped" in stack.output().splitlines()[-1]
        assert not [pid for pid in children if alive(pid)], "processes left behind"
    finally:
        stack.close()
