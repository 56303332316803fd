"""schemathesis against a live stack (web server + a tiny-model engine worker): the requests that pass every check
reach the engine here, so the sampling-parameter and engine-side paths are fuzzed too.
"""

from __future__ import annotations

import os

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings

from tests.platform.fuzz.fuzz_checks import check_response
from tests.platform.live_stack import live_stack  # noqa: F401  (the shared session-scoped live stack)

pytestmark = pytest.mark.slow
MAX_EXAMPLES = int(os.environ.get("FUZZ_MAX_EXAMPLES", 25))
GENERATED_TOKENS_CAP = 8  # bounds the run's time; values that are not plain ints are sent as generated


def _aimed(case, model: str) -> None:
    """Generation requests name the served model (a random name stops at 404) and generate few tokens."""
    body = case.body if isinstance(case.body, dict) else None
    if body is not None and "completions" in case.path:
        if "model" in body:
            body["model"] = model
        for name in ("max_tokens", "max_completion_tokens"):
            if type(body.get(name)) is int and body[name] > GENERATED_TOKENS_CAP:
                body[name] = GENERATED_TOKENS_CAP
        if "max_tokens" not in body and "max_completion_tokens" not in body:
            body["max_tokens"] = GENERATED_TOKENS_CAP


def test_no_5xx_against_the_live_stack(live_stack):  # noqa: F811
    # schemathesis' pytest fixture loader does not work with this pytest; the same strategies, driven by hand.
    schema = schemathesis.openapi.from_url(live_stack.base_url + "/v1/openapi.json")
    auth = {"Authorization": f"Bearer {live_stack.api_key}"}
    for result in schema.get_all_operations():
        operation = result.ok()

        @settings(
            max_examples=MAX_EXAMPLES,
            derandomize=os.environ.get("FUZZ_RANDOM") != "1",
            deadline=None,
            suppress_health_check=list(HealthCheck),
            database=None,
        )
        @given(case=operation.as_strategy())
        def fuzz(case):
            _aimed(case, live_stack.model_name)
            check_response(case, case.call(headers=auth, timeout=60))

        fuzz()
