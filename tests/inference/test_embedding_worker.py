"""An engine worker serving an encoder model over the real Redis protocol: one embedding event, then finish."""

from __future__ import annotations

import pytest
import torch
from django.conf import settings

from engine_client import client as engine_client
from inference import LLM, protocol
from inference.pooling import PoolingParams
from tests.inference.worker_helpers import ThreadedWorker, llm, r, wait_for  # noqa: F401 (fixtures)
from tests.tiny_models import make_tiny_bert

EMBED_MODEL = "tiny-embed"


@pytest.fixture(scope="module")
def bert_llm(tmp_path_factory):
    path = make_tiny_bert(tmp_path_factory.mktemp("bert") / "tiny", "mean", matryoshka_dimensions=[64, 16])
    return LLM(model=str(path), dtype="float32", device="cpu", max_num_seqs=8, max_num_batched_tokens=256)


@pytest.fixture
def embed_worker(bert_llm, r):  # noqa: F811
    running = ThreadedWorker(bert_llm.llm_engine, settings.REDIS_URL, model_name=EMBED_MODEL).start()
    wait_for(lambda: r.exists(protocol.heartbeat_key(running.worker.worker_id)))
    yield running
    running.stop()


def embed(prompt_ids: list[int], pooling_params: dict | None = None, model: str = EMBED_MODEL) -> list[dict]:
    client = engine_client.client()
    rid = client.submit(model=model, prompt_token_ids=prompt_ids, pooling_params=pooling_params or {})
    return [e for e in client.stream(rid, timeout=30)]


def test_the_worker_answers_each_request_with_its_embedding_then_finish(bert_llm, embed_worker, r):  # noqa: F811
    tokenizer = bert_llm.get_tokenizer()
    prompts = [tokenizer.encode(text) for text in ("the first text", "and a second, longer one for the batch")]
    expected = [o.embedding for o in bert_llm.embed([{"prompt_token_ids": p} for p in prompts], use_tqdm=False)]
    client = engine_client.client()
    rids = [client.submit(model=EMBED_MODEL, prompt_token_ids=p, pooling_params={}) for p in prompts]
    for rid, prompt, vector in zip(rids, prompts, expected):
        events = list(client.stream(rid, timeout=30))
        assert [e["type"] for e in events] == ["embedding", "finish"]
        embedding, finish = events
        assert embedding["dimensions"] == 64
        # the worker may take the two in one step or in two; a float32 GEMM's rounding follows its row count
        assert torch.allclose(torch.tensor(protocol.embedding_floats(embedding)), vector, rtol=1e-5, atol=1e-6)
        assert finish["finish_reasons"] == ["stop"]
        assert finish["usage"] == {"prompt_tokens": len(prompt), "completion_tokens": 0, "cached_tokens": 0}
        assert finish["metrics"]["ttft_ms"] is not None
    assert r.xpending(protocol.request_stream(EMBED_MODEL), protocol.CONSUMER_GROUP)["pending"] == 0


def test_dimensions_reach_the_engine(bert_llm, embed_worker):
    prompt = bert_llm.get_tokenizer().encode("truncated to sixteen")
    [expected] = bert_llm.embed([{"prompt_token_ids": prompt}], PoolingParams(dimensions=16), use_tqdm=False)
    embedding, _finish = embed(prompt, {"dimensions": 16})
    assert embedding["dimensions"] == 16
    assert torch.equal(torch.tensor(protocol.embedding_floats(embedding)), expected.embedding)


def test_requests_the_model_cannot_serve_end_with_invalid_request(bert_llm, embed_worker, llm, r):  # noqa: F811
    prompt = bert_llm.get_tokenizer().encode("some text")
    [error] = embed(prompt, {"dimensions": 48})
    assert error["type"] == "error" and error["code"] == "invalid_request" and "dimensions" in error["message"]
    client = engine_client.client()
    rid = client.submit(model=EMBED_MODEL, prompt_token_ids=prompt, sampling_params={"max_tokens": 4})
    [error] = list(client.stream(rid, timeout=30))
    assert error["code"] == "invalid_request" and "is an embedding model" in error["message"]
    [error] = embed([1] * 500)
    assert error["code"] == "invalid_request" and "maximum is 96" in error["message"]
    chat = ThreadedWorker(llm.llm_engine, settings.REDIS_URL, model_name="tiny-chat").start()
    try:
        [error] = embed([5, 6, 7], model="tiny-chat")
        assert error["code"] == "invalid_request" and "does not make embeddings" in error["message"]
    finally:
        chat.stop()
    [embedding, finish] = embed(prompt)  # the worker goes on serving
    assert finish["type"] == "finish"
