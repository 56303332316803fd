"""The web process loads the served model's tokenizer and chat template before it listens (issue #32:
the first chat after `ready:` waited seconds for them)."""

from __future__ import annotations

from django.test import override_settings

from generation import tokenization
from tessera import web


def test_web_warm_up_loads_the_served_models_tokenizer_before_serving(tiny_model_dir):
    tokenization._load.cache_clear()
    with override_settings(MODEL=tiny_model_dir):
        web.warm_up()
    assert tokenization._load.cache_info().currsize == 1
    hits = tokenization._load.cache_info().hits
    # the first chat's prompt is then built from the loaded tokenizer, not a new load
    assert tokenization.chat_prompt_ids(tiny_model_dir, [{"role": "user", "content": "Hi"}])
    assert tokenization._load.cache_info().hits == hits + 1 and tokenization._load.cache_info().currsize == 1


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
