"""`make run` serves the embedding model beside the chat model; EMBEDDING_MODEL picks another or turns it off."""

from __future__ import annotations

import json
import re
import signal
import time
from pathlib import Path

import numpy as np
import pytest

from inference.embedding_models import BUNDLED_NAME, bundled_embedding_model
from tessera import run
from tests.platform.run_stack import RunStack, make_run_env

REPO = Path(__file__).resolve().parents[2]


def test_by_default_a_second_engine_worker_serves_the_bundled_minilm(tmp_path):
    cfg = run.RunConfig.from_env({"TESSERA_VAR_DIR": str(tmp_path)})
    assert cfg.embedding.name == BUNDLED_NAME and cfg.embedding.path == str(bundled_embedding_model())
    commands = run.service_commands(cfg)
    assert set(commands) == {"engine", "embed", "worker", "beat", "web"}
    assert commands["embed"][1:] == [
        str(REPO / "manage.py"),
        "engine",
        "--model",
        cfg.embedding.path,
        "--arg",
        f"served_model_name={BUNDLED_NAME}",
    ]


def test_embedding_model_picks_another_folder_or_turns_it_off(tmp_path):
    folder = tmp_path / "my-encoder"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    picked = run.RunConfig.from_env({"TESSERA_VAR_DIR": str(tmp_path), "EMBEDDING_MODEL": str(folder)}).embedding
    assert (picked.path, picked.name) == (str(folder), "my-encoder")
    named = run.RunConfig.from_env(
        {"TESSERA_VAR_DIR": str(tmp_path), "EMBEDDING_MODEL": str(folder), "EMBEDDING_SERVED_MODEL_NAME": "enc"}
    ).embedding
    assert named.name == "enc"
    off = run.RunConfig.from_env({"TESSERA_VAR_DIR": str(tmp_path), "EMBEDDING_MODEL": "off"})
    assert off.embedding is None and "embed" not in run.service_commands(off)
    with pytest.raises(SystemExit, match="is not a model folder"):
        run.RunConfig.from_env({"TESSERA_VAR_DIR": str(tmp_path), "EMBEDDING_MODEL": str(tmp_path / "missing")})


def test_the_embedding_worker_does_not_take_the_chat_models_engine_arguments():
    env = {
        "ENGINE_ARGS": '{"max_model_len": 2048}',
        "ENGINE_MAX_NUM_SEQS": "4",
        "ENGINE_WORKER_ID": "chat-1",
        "ENGINE_SERVED_MODEL_ALIASES": "chat",
        "ENGINE_HEARTBEAT_TTL": "3",
        "EMBEDDING_ENGINE_ARGS": '{"seed": 1}',
        "REDIS_URL": "redis://x",
    }
    assert run.embedding_env(env) == {
        "ENGINE_ARGS": '{"seed": 1}',
        "ENGINE_HEARTBEAT_TTL": "3",
        "EMBEDDING_ENGINE_ARGS": '{"seed": 1}',
        "REDIS_URL": "redis://x",
    }
    assert run.embedding_env({})["ENGINE_ARGS"] == "{}"


@pytest.mark.slow
def test_make_run_answers_chat_and_embeddings_side_by_side(tiny_model_dir, tmp_path):
    from openai import OpenAI
    from sentence_transformers import SentenceTransformer

    env = make_run_env(
        tiny_model_dir,
        tmp_path / "var",
        EMBEDDING_MODEL="",
        EMBEDDING_ENGINE_ARGS=json.dumps({"max_num_batched_tokens": 512, "max_num_seqs": 16}),
    )
    stack = RunStack.start(env, tmp_path / "run.log")
    try:
        text = stack.output()
        assert re.search(rf"^  embeddings:  {BUNDLED_NAME} ", text, re.MULTILINE)
        assert re.search(r"^embed\s+\| ", text, re.MULTILINE), "no output from the embedding worker"
        _, api_key = stack.admin_login()
        client = OpenAI(base_url=stack.base_url + "/v1", api_key=api_key, max_retries=0)
        stack_models = lambda: {m.id for m in client.models.list()}  # noqa: E731
        _wait(lambda: BUNDLED_NAME in stack_models(), stack)
        assert len(stack_models()) == 2
        texts = ["make run serves embeddings", "beside the chat model"]
        reply = client.embeddings.create(model=BUNDLED_NAME, input=texts, encoding_format="float")
        expected = SentenceTransformer(str(bundled_embedding_model()), device="cpu").encode(texts)
        assert np.abs(np.array([d.embedding for d in reply.data]) - expected).max() < 1e-5
        chat_model = (stack_models() - {BUNDLED_NAME}).pop()
        assert client.completions.create(model=chat_model, prompt="Hello", max_tokens=4).usage.completion_tokens >= 1
        stack.process.send_signal(signal.SIGINT)
        assert stack.process.wait(90) == 0
    finally:
        stack.close()


def _wait(predicate, stack, timeout: float = 180.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, stack.output()[-4000:]
        time.sleep(0.3)
