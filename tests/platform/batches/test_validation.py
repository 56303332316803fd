"""Validation of batch input files: every bad line is listed with its line number and nothing runs."""

from __future__ import annotations

import json

import pytest
from batch_testing import chat_line, jsonl

from batches import services
from batches.models import Batch, BatchLine
from batches.validation import validate_jsonl


def allow_all(model):
    return None


def no_body_problem(url, body):
    return None


def test_validate_jsonl_lists_each_problem_with_its_line_number():
    content = jsonl(
        [
            chat_line("a"),
            "{not json",
            chat_line("a"),  # duplicate of line 1
            {**chat_line("c"), "url": "/v1/moderations"},
            {**chat_line("d"), "method": "GET"},
            {**chat_line("e"), "body": "text"},
            {"method": "POST", "url": "/v1/chat/completions", "body": {"model": "tiny"}},
            [1, 2],
        ]
    )
    result = validate_jsonl(
        content, "/v1/chat/completions", check_model=allow_all, check_body=no_body_problem, max_lines=100
    )
    assert [(e["line"], e["code"]) for e in result.errors] == [
        (2, "invalid_json_line"),
        (3, "duplicate_custom_id"),
        (4, "invalid_url"),
        (5, "invalid_method"),
        (6, "invalid_body"),
        (7, "invalid_custom_id"),
        (8, "invalid_json_line"),
    ]
    assert "line 1" in result.errors[1]["message"]
    assert [line.custom_id for line in result.lines] == ["a"]
    assert not result.ok


def test_a_line_holding_nul_is_refused_naming_its_line():
    # The lines are kept in the database, and PostgreSQL's jsonb cannot hold \u0000.
    content = jsonl([chat_line("a"), chat_line("n", content="a\x00b")])
    result = validate_jsonl(
        content, "/v1/chat/completions", check_model=allow_all, check_body=no_body_problem, max_lines=100
    )
    assert [(e["line"], e["code"]) for e in result.errors] == [(2, "invalid_json_line")]
    assert "NUL" in result.errors[0]["message"]


def test_validate_jsonl_checks_endpoint_model_and_body_through_callbacks():
    content = jsonl([chat_line("ok"), chat_line("m", model="gpt-9"), {**chat_line("u"), "url": "/v1/completions"}])
    result = validate_jsonl(
        content,
        "/v1/chat/completions",
        check_model=lambda m: None if m == "tiny" else f"no model {m}",
        check_body=no_body_problem,
        max_lines=100,
    )
    assert [(e["line"], e["code"], e["param"]) for e in result.errors] == [
        (2, "model_not_allowed", "body.model"),
        (3, "mismatched_endpoint", "url"),
    ]


def test_validate_jsonl_skips_blank_lines_and_limits_line_count():
    content = jsonl([chat_line("a"), "", chat_line("b"), chat_line("c")])
    ok = validate_jsonl(content, "/v1/chat/completions", check_model=allow_all, check_body=no_body_problem, max_lines=3)
    assert ok.ok and [ln.line_number for ln in ok.lines] == [1, 3, 4]
    too_many = validate_jsonl(
        content, "/v1/chat/completions", check_model=allow_all, check_body=no_body_problem, max_lines=2
    )
    assert too_many.errors[-1]["code"] == "too_many_lines" and too_many.errors[-1]["line"] == 4


def test_validate_jsonl_empty_and_non_utf8_files_fail():
    empty = validate_jsonl(b"\n\n", "/v1/completions", check_model=allow_all, check_body=no_body_problem, max_lines=5)
    assert [e["code"] for e in empty.errors] == ["empty_file"]
    binary = validate_jsonl(
        b"\xff\xfe", "/v1/completions", check_model=allow_all, check_body=no_body_problem, max_lines=5
    )
    assert [e["code"] for e in binary.errors] == ["invalid_file"]


def _batch_from(user, content: bytes, endpoint="/v1/chat/completions") -> Batch:
    file = services.upload_file(user, content=content, filename="in.jsonl", purpose="batch")
    return services.create_batch(user, input_file_id=file.public_id, endpoint=endpoint, completion_window="24h")


@pytest.mark.django_db
def test_validation_fails_the_batch_listing_every_bad_line_and_stores_no_lines(user):
    content = jsonl(
        [
            chat_line("good-1"),
            '{"custom_id": "broken", ',
            chat_line("good-1"),
            {**chat_line("wrong-url"), "url": "/v1/images"},
            chat_line("bad-model", model="not-served"),
            chat_line("bad-temperature", temperature=7),
            {**chat_line("no-messages"), "body": {"model": "tiny", "messages": []}},
            chat_line("over-plan", max_tokens=100_000),
            chat_line("streaming", stream=True),
            chat_line("good-2"),
        ]
    )
    batch = _batch_from(user, content)
    services.validate_batch(batch.pk)
    batch.refresh_from_db()
    assert batch.status == Batch.Status.FAILED and batch.failed_at is not None
    found = {(e["line"], e["code"]) for e in batch.errors}
    assert found == {
        (2, "invalid_json_line"),
        (3, "duplicate_custom_id"),
        (4, "invalid_url"),
        (5, "model_not_allowed"),
        (6, "invalid_body"),
        (7, "invalid_body"),
        (8, "invalid_body"),
        (9, "invalid_body"),
    }
    by_line = {e["line"]: e for e in batch.errors}
    assert by_line[6]["param"] == "body.temperature"
    assert by_line[7]["param"].startswith("body.messages")
    assert "512" in by_line[8]["message"]  # the plan's max_tokens cap
    assert not BatchLine.objects.filter(batch=batch).exists()
    assert batch.output_file is None and batch.error_file is None


@pytest.mark.django_db
def test_valid_file_moves_to_in_progress_with_one_row_per_line(user, django_capture_on_commit_callbacks):
    batch = _batch_from(user, jsonl([chat_line(f"req-{i}") for i in range(5)]))
    with django_capture_on_commit_callbacks(execute=False) as callbacks:
        services.validate_batch(batch.pk)
    batch.refresh_from_db()
    assert batch.status == Batch.Status.IN_PROGRESS and batch.in_progress_at and batch.total == 5
    assert list(batch.lines.values_list("custom_id", flat=True)) == [f"req-{i}" for i in range(5)]
    assert len(callbacks) == 1  # run_batch is enqueued once the lines are committed
    services.validate_batch(batch.pk)  # a redelivered task changes nothing
    assert batch.lines.count() == 5


@pytest.mark.django_db
def test_completions_lines_validate_against_the_completions_serializer(user):
    lines = [
        {
            "custom_id": "t",
            "method": "POST",
            "url": "/v1/completions",
            "body": {"model": "tiny", "prompt": "Once upon", "max_tokens": 3},
        },
        {
            "custom_id": "ids",
            "method": "POST",
            "url": "/v1/completions",
            "body": {"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 3},
        },
        {"custom_id": "bad", "method": "POST", "url": "/v1/completions", "body": {"model": "tiny", "prompt": {"x": 1}}},
    ]
    batch = _batch_from(user, jsonl(lines), endpoint="/v1/completions")
    services.validate_batch(batch.pk)
    batch.refresh_from_db()
    assert [(e["line"], e["code"], e["param"]) for e in batch.errors] == [(3, "invalid_body", "body.prompt")]
    assert json.loads(json.dumps(batch.errors))  # stored as plain JSON
