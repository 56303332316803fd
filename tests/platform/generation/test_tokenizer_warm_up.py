"""The web process loads the served model's tokenizer and chat template, and imports its URLconf, before it
listens (issue #32: the first chat after `ready:` waited seconds for them, the first /v1 request ~100 ms)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from django.test import override_settings

from generation import tokenization
from tessera import web


def test_web_warm_up_loads_the_served_models_tokenizer_before_serving(tiny_model_dir):
    tokenization._load.cache_clear()
    tokenization.longest_token_chars.cache_clear()
    with override_settings(MODEL=tiny_model_dir):
        web.warm_up()
    assert tokenization._load.cache_info().currsize == 1
    assert tokenization.longest_token_chars.cache_info().currsize == 1  # the prompt-length check's bound
    hits = tokenization._load.cache_info().hits
    # the first chat's prompt is then built from the loaded tokenizer, not a new load
    assert tokenization.chat_prompt_ids(tiny_model_dir, [{"role": "user", "content": "Hi"}])
    assert tokenization._load.cache_info().hits == hits + 1 and tokenization._load.cache_info().currsize == 1


def test_web_warm_up_imports_the_urlconf_before_serving(tiny_model_dir):
    """In a fresh process, as `python -m tessera.web` starts: after warm_up every view module is imported and
    the resolver holds its patterns, so the first request routes without importing them."""
    repo = Path(__file__).resolve().parents[3]
    probe = (
        "import sys; from tessera import web; web.warm_up(); "
        "from django.urls import get_resolver; "
        "print('url_patterns' in vars(get_resolver()), 'openai_api.views' in sys.modules)"
    )
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "tessera.settings.test",
        "MODEL": tiny_model_dir,
        "PYTHONPATH": f"{repo}{os.pathsep}{repo / 'platform'}",
    }
    done = subprocess.run(
        [sys.executable, "-c", probe], cwd=repo, env=env, capture_output=True, text=True, timeout=120, check=True
    )
    assert done.stdout.split() == ["True", "True"]


def test_a_model_that_cannot_load_here_does_not_stop_the_web_process(tmp_path):
    assert tokenization.warm_up(str(tmp_path / "missing")) is False


def test_the_web_process_freezes_what_warm_up_allocated_and_collects_rarely_when_it_serves(monkeypatch):
    """Under load a collection then walks only the open requests' objects, not Django's and torch's, and
    comes every 50,000 new objects instead of 700 (a flood's open streams made a full one every few seconds)."""
    import gc

    frozen_when_serving, thresholds_when_serving = [], []
    thresholds = gc.get_threshold()

    class Server:
        def __init__(self, config):
            pass

        def run(self):
            frozen_when_serving.append(gc.get_freeze_count())
            thresholds_when_serving.append(gc.get_threshold())

    monkeypatch.setattr(web, "warm_up", lambda: None)
    monkeypatch.setattr(web.uvicorn, "Server", Server)
    try:
        web.main(["--port", "0"])
    finally:
        gc.unfreeze()  # this test process keeps collecting as before
        gc.set_threshold(*thresholds)
    assert frozen_when_serving[0] > 10_000
    assert thresholds_when_serving == [web.GC_THRESHOLDS] and web.GC_THRESHOLDS[0] >= 10_000
