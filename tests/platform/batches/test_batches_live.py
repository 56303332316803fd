"""Batches end to end: the official `openai` client against the web server + a REAL Celery worker (and beat)
+ an engine worker with the tiny model + a private Redis + a SQLite file.

Covers: a 200-line batch (every custom_id exactly once; greedy outputs equal the same requests sent
one by one), a Celery worker SIGKILLed mid-batch and restarted, cancel mid-run, expiry mid-run,
and the TTFT of an interactive request while a batch runs.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from collections import Counter

import openai
import pytest

from tests.platform.live_stack import BIN_DIR, LiveStack

pytestmark = pytest.mark.slow

# Short leases and a fast watchdog so a dead worker's batch is picked up within seconds.
BATCH_ENV = {
    "BATCH_LEASE_SECONDS": "4",
    "BATCH_WATCHDOG_INTERVAL": "1",
    "BATCH_MAX_IN_FLIGHT": "8",
    "BATCH_PROGRESS_INTERVAL": "0.2",
}
CELERY_WORKER = [
    str(BIN_DIR / "celery"),
    "-A",
    "tessera",
    "worker",
    "-l",
    "info",
    "-c",
    "2",
    "--without-gossip",
    "--without-mingle",
]


@pytest.fixture(scope="module")
def stack(tiny_model_dir, tmp_path_factory):
    work = tmp_path_factory.mktemp("batches-live")
    with LiveStack.start(tiny_model_dir, work, env=BATCH_ENV, celery=True) as live:
        live.sql("PRAGMA journal_mode=WAL")  # web, Celery and engine write the same file concurrently
        live.spawn(
            "beat", [str(BIN_DIR / "celery"), "-A", "tessera", "beat", "-l", "info", "-s", str(work / "beat-schedule")]
        )
        yield live


@pytest.fixture(scope="module")
def client(stack):
    return openai.OpenAI(base_url=stack.base_url + "/v1", api_key=stack.api_key, max_retries=0, timeout=120)


KILL_TOKENS = 64


def chat_lines(stack, n: int, max_tokens: int, prefix: str = "req", ignore_eos: bool = False) -> list[dict]:
    lines = []
    for i in range(n):
        body = {
            "model": stack.model_name,
            "max_tokens": max_tokens,
            "temperature": 0,
            "messages": [{"role": "user", "content": f"Item {i}: tell me about number {i * 7 % 13}."}],
        }
        if ignore_eos:
            body["ignore_eos"] = True
        lines.append({"custom_id": f"{prefix}-{i}", "method": "POST", "url": "/v1/chat/completions", "body": body})
    return lines


def start_batch(client, lines: list[dict]):
    content = "".join(json.dumps(line) + "\n" for line in lines).encode()
    file = client.files.create(file=("batch.jsonl", content), purpose="batch")
    return client.batches.create(input_file_id=file.id, endpoint="/v1/chat/completions", completion_window="24h")


def wait_batch(client, batch_id: str, until, timeout: float, stack=None):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        batch = client.batches.retrieve(batch_id)
        if until(batch):
            return batch
        time.sleep(0.3)
    logs = "" if stack is None else f"\n--- celery\n{stack.log_tail('celery', 60)}"
    raise AssertionError(f"batch {batch_id} stuck: {batch.status} {batch.request_counts}{logs}")


def done(batch) -> bool:
    return batch.status in ("completed", "failed", "cancelled", "expired")


def read_results(client, batch) -> tuple[list[dict], list[dict]]:
    def rows(file_id):
        if not file_id:
            return []
        return [json.loads(line) for line in client.files.content(file_id).text.splitlines() if line.strip()]

    return rows(batch.output_file_id), rows(batch.error_file_id)


def assert_each_once(lines, output, errors):
    seen = Counter(row["custom_id"] for row in output + errors)
    assert set(seen) == {line["custom_id"] for line in lines}
    assert max(seen.values()) == 1, [cid for cid, n in seen.items() if n > 1]


def test_200_line_batch_every_line_once_and_equal_to_one_by_one_requests(client, stack):
    lines = chat_lines(stack, 200, max_tokens=6)
    batch = start_batch(client, lines)
    assert batch.status == "validating"
    final = wait_batch(client, batch.id, done, timeout=400, stack=stack)
    assert final.status == "completed", final
    assert (final.request_counts.total, final.request_counts.completed, final.request_counts.failed) == (200, 200, 0)
    assert final.in_progress_at and final.finalizing_at and final.completed_at
    output, errors = read_results(client, final)
    assert errors == [] and final.error_file_id is None
    assert_each_once(lines, output, errors)
    for row in output:
        assert row["error"] is None and row["response"]["status_code"] == 200 and row["id"].startswith("batch_req_")
    assert final.usage.output_tokens == sum(r["response"]["body"]["usage"]["completion_tokens"] for r in output)

    by_id = {row["custom_id"]: row["response"]["body"] for row in output}
    for line in lines:  # the same requests one by one through the live endpoint
        reply = client.chat.completions.create(**line["body"])
        assert reply.choices[0].message.content == by_id[line["custom_id"]]["choices"][0]["message"]["content"]
        assert reply.usage.prompt_tokens == by_id[line["custom_id"]]["usage"]["prompt_tokens"]

    sources = dict(stack.sql("SELECT source, COUNT(*) FROM usage_usagerecord GROUP BY source"))
    assert sources.get("batch") == 200  # one usage row per line, source "batch"
    # both TTFTs: from the line's submission (queue + engine) and from the worker's acceptance (inside it)
    ttfts = stack.sql("SELECT ttft_ms, engine_ttft_ms FROM usage_usagerecord WHERE source = 'batch'")
    assert all(0 < engine <= submitted for submitted, engine in ttfts), ttfts[:5]


def test_celery_worker_killed_mid_batch_restarts_and_every_line_runs_once(client, stack):
    # Long enough that the batch is still running when the worker dies (the engine got faster).
    lines = chat_lines(stack, 48, max_tokens=KILL_TOKENS, prefix="kill", ignore_eos=True)
    assert _engine_drains(stack)
    tokens_before = generated_tokens(stack)
    batch = start_batch(client, lines)
    wait_batch(client, batch.id, lambda b: b.request_counts.completed >= 8, timeout=300, stack=stack)
    stack.kill("celery")  # SIGKILL to the worker's whole process group, mid-batch
    frozen = client.batches.retrieve(batch.id)
    assert frozen.status == "in_progress" and frozen.request_counts.completed < 48
    time.sleep(1.0)
    stack.spawn("celery", CELERY_WORKER)
    final = wait_batch(client, batch.id, done, timeout=400, stack=stack)
    assert final.status == "completed" and final.request_counts.completed == 48, final
    output, errors = read_results(client, final)
    assert errors == []
    assert_each_once(lines, output, errors)
    assert all(row["response"]["body"]["usage"]["completion_tokens"] == KILL_TOKENS for row in output)
    request_ids = [row["response"]["request_id"] for row in output]
    marks = ",".join("?" * len(request_ids))
    usage = stack.sql(f"SELECT request_id FROM usage_usagerecord WHERE request_id IN ({marks})", tuple(request_ids))
    assert sorted(r[0] for r in usage) == sorted(request_ids)  # usage recorded exactly once per line
    attempts = Counter(
        n
        for (n,) in stack.sql(
            "SELECT l.attempts FROM batches_batchline l JOIN batches_batch b ON b.id = l.batch_id "
            "WHERE b.public_id = ?",
            (batch.id,),
        )
    )
    print(f"attempts per line after the kill: {dict(attempts)}", file=sys.stderr)
    time.sleep(1.5)  # one more heartbeat
    generated = generated_tokens(stack) - tokens_before
    assert generated == 48 * KILL_TOKENS, "lines in flight at the kill were re-attached, not generated again"


def test_cancel_mid_run_keeps_finished_lines_and_closes_the_rest(client, stack):
    # 160 tokens a line: the batch must still be running when the cancel arrives (at 32 tokens the
    # faster engine sometimes finished all 60 lines first).
    lines = chat_lines(stack, 60, max_tokens=160, prefix="cancel", ignore_eos=True)
    batch = start_batch(client, lines)
    wait_batch(client, batch.id, lambda b: b.request_counts.completed >= 2, timeout=300, stack=stack)
    cancelling = client.batches.cancel(batch.id)
    assert cancelling.status in ("cancelling", "cancelled")
    final = wait_batch(client, batch.id, done, timeout=120, stack=stack)
    assert final.status == "cancelled" and final.cancelled_at and final.cancelling_at
    output, errors = read_results(client, final)
    assert_each_once(lines, output, errors)
    assert 2 <= len(output) < 60 and final.request_counts.completed == len(output)
    assert {row["error"]["code"] for row in errors} == {"batch_cancelled"}
    assert stack.worker_stats()[0]["num_running"] == 0 or _engine_drains(stack)


def generated_tokens(stack) -> int:
    return sum(s["generation_tokens_total"] for s in stack.worker_stats())


def _engine_drains(stack, timeout: float = 10.0) -> bool:
    """Every worker idle in a heartbeat snapshot taken after this call began: an older one can show
    an idle moment between two requests without the tokens of those that ran since."""
    since = time.time()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        stats = stack.worker_stats()
        if stats and all(
            s.get("last_step_at", 0) > since and s.get("num_running", 0) == 0 and s.get("num_waiting", 0) == 0
            for s in stats
        ):
            return True
        time.sleep(0.2)
    return False


def test_expiry_mid_run_finalizes_partial_output_and_marks_the_rest_expired(client, stack):
    lines = chat_lines(stack, 60, max_tokens=32, prefix="exp", ignore_eos=True)
    batch = start_batch(client, lines)
    wait_batch(client, batch.id, lambda b: b.request_counts.completed >= 2, timeout=300, stack=stack)
    stack.sql("UPDATE batches_batch SET expires_at = datetime('now', '-1 second') WHERE public_id = ?", (batch.id,))
    final = wait_batch(client, batch.id, done, timeout=120, stack=stack)
    assert final.status == "expired" and final.expired_at
    output, errors = read_results(client, final)
    assert_each_once(lines, output, errors)
    assert len(output) == final.request_counts.completed >= 2
    assert errors and {row["error"]["code"] for row in errors} == {"batch_expired"}
    assert all(row["response"] is None for row in errors)


def ttft(client, stack) -> float:
    started = time.perf_counter()
    stream = client.chat.completions.create(
        model=stack.model_name,
        max_tokens=4,
        temperature=0,
        stream=True,
        messages=[{"role": "user", "content": "Quick question?"}],
    )
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            elapsed = time.perf_counter() - started
            stream.close()
            return elapsed
    raise AssertionError("no content arrived")


def measure_idle_and_busy_ttft(client, stack, attempt: int) -> tuple[float, float]:
    assert _engine_drains(stack)
    ttft(client, stack)  # warm-up
    idle_samples = [ttft(client, stack) for _ in range(9)]
    lines = chat_lines(stack, 80, max_tokens=48, prefix=f"ttft{attempt}", ignore_eos=True)
    batch = start_batch(client, lines)
    wait_batch(client, batch.id, lambda b: b.request_counts.completed >= 1, timeout=300, stack=stack)
    busy_samples = [ttft(client, stack) for _ in range(9)]
    still_running = client.batches.retrieve(batch.id)
    client.batches.cancel(batch.id)
    wait_batch(client, batch.id, done, timeout=120, stack=stack)
    assert still_running.status == "in_progress", "the batch must still be running while TTFT is measured"
    idle, busy = statistics.median(idle_samples), statistics.median(busy_samples)
    print(
        f"TTFT idle {idle * 1000:.1f} ms, during batch {busy * 1000:.1f} ms; samples (ms): "
        f"{[round(t * 1000) for t in idle_samples]} / {[round(t * 1000) for t in busy_samples]}",
        file=sys.stderr,
    )
    return idle, busy


def test_interactive_ttft_while_a_batch_runs_stays_within_twice_idle(client, stack):
    # The CPUs are shared with other work, so one noisy round is measured again (idle and busy both).
    for attempt in range(2):
        idle, busy = measure_idle_and_busy_ttft(client, stack, attempt)
        if busy <= 2 * idle:
            break
    assert busy <= 2 * idle, (idle, busy)
