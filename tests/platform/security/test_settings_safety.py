"""Prod settings: DEBUG off and SECRET_KEY required. `make run`: DEBUG never on a network-facing bind."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from tessera import exposure

REPO_DIR = Path(__file__).resolve().parents[3]
PRINT_SETTINGS = (
    "import django; django.setup(); from django.conf import settings as s; "
    "print(s.DEBUG, s.ALLOW_SIGNUP, s.SECRET_KEY == 'dev-insecure-change-me')"
)


def _settings(module: str, **env) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if k not in ("SECRET_KEY", "DEBUG", "ALLOW_SIGNUP")}
    return subprocess.run(
        [sys.executable, "-c", PRINT_SETTINGS],
        cwd=REPO_DIR,
        capture_output=True,
        text=True,
        timeout=120,
        env={
            **clean,
            "DJANGO_SETTINGS_MODULE": module,
            "PYTHONPATH": f"{REPO_DIR}{os.pathsep}{REPO_DIR / 'platform'}",
            **env,
        },
    )


@pytest.mark.parametrize("secret", [None, "", exposure.DEV_SECRET_KEY])
def test_prod_settings_refuse_to_start_without_a_real_secret_key(secret):
    done = _settings("tessera.settings.prod", **({} if secret is None else {"SECRET_KEY": secret}))
    assert done.returncode != 0
    assert "ImproperlyConfigured" in done.stderr and "needs SECRET_KEY" in done.stderr


def test_prod_settings_keep_debug_and_signup_off_whatever_the_env_says():
    done = _settings("tessera.settings.prod", SECRET_KEY="x" * 50, DEBUG="1")
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["False", "False", "False"]
    opened = _settings("tessera.settings.prod", SECRET_KEY="x" * 50, ALLOW_SIGNUP="1")
    assert opened.stdout.split()[1] == "True"


def test_dev_settings_default_to_debug_and_open_signup():
    assert _settings("tessera.settings.dev").stdout.split() == ["True", "True", "True"]


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost", "::1", "127.0.0.2"])
def test_loopback_changes_nothing(host, tmp_path):
    assert exposure.network_safe_env(host, {"DEBUG": "1"}, tmp_path) == {}
    assert not (tmp_path / exposure.SECRET_KEY_FILE).exists()


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "192.168.1.20", "tessera.example.com"])
def test_a_network_bind_with_debug_explicitly_on_is_refused(host, tmp_path):
    with pytest.raises(SystemExit, match="refusing to serve"):
        exposure.network_safe_env(host, {"DEBUG": "1"}, tmp_path)


def test_a_network_bind_turns_debug_off_and_uses_a_private_secret_key(tmp_path):
    changes = exposure.network_safe_env("0.0.0.0", {}, tmp_path)
    key_file = tmp_path / exposure.SECRET_KEY_FILE
    assert changes["DEBUG"] == "0" and changes["SECRET_KEY"] == key_file.read_text().strip()
    assert len(changes["SECRET_KEY"]) >= 50 and changes["SECRET_KEY"] != exposure.DEV_SECRET_KEY
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o600
    assert exposure.network_safe_env("0.0.0.0", {}, tmp_path) == changes  # the same key on every start
    assert exposure.network_safe_env("0.0.0.0", {"SECRET_KEY": "mine" * 10}, tmp_path) == {"DEBUG": "0"}


def test_the_dev_settings_under_those_changes_have_debug_off(tmp_path):
    changes = exposure.network_safe_env("0.0.0.0", {}, tmp_path)
    assert _settings("tessera.settings.dev", **changes).stdout.split() == ["False", "True", "False"]


def test_make_run_refuses_host_0000_with_debug_on_before_starting_anything(tmp_path):
    env = {
        **os.environ,
        "HOST": "0.0.0.0",
        "DEBUG": "1",
        "TESSERA_VAR_DIR": str(tmp_path),
        "MODEL": str(tmp_path / "no-model"),
        "PYTHONPATH": f"{REPO_DIR}{os.pathsep}{REPO_DIR / 'platform'}",
    }
    done = subprocess.run(
        [sys.executable, "-m", "tessera.run"], cwd=REPO_DIR, env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode != 0 and "refusing to serve HOST=0.0.0.0 with DEBUG=1" in done.stderr
    assert "is not a folder" not in done.stderr + done.stdout  # refused before looking at the model


def test_private_secrets_are_owner_only_and_stable(tmp_path):
    from tessera.private_files import read_or_create_secret

    path = tmp_path / "nested" / "secret"
    first = read_or_create_secret(path, 24)
    assert len(first) >= 24 and read_or_create_secret(path, 24) == first
    assert path.stat().st_mode & 0o777 == 0o600
