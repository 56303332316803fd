"""Property-based fuzzing of the chat message validator, through the real ASGI app: any `messages` value
gets a 400 naming a place inside `messages` or passes on (503: no engine worker here), never a 5xx.
"""

from __future__ import annotations

import json

import pytest
from django.contrib.auth.models import User
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from accounts.services import create_api_key
from tests.platform.security.asgi_calls import call, is_envelope, no_engine_workers

pytestmark = pytest.mark.django_db(transaction=True)
FUZZ = settings(
    max_examples=150,
    derandomize=True,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)

scalars = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=12)
json_values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=10,
)
roles = st.sampled_from(["system", "user", "assistant", "tool", "developer", "function", "robot", "", "USER"]) | scalars
parts = st.fixed_dictionaries(
    {"type": st.sampled_from(["text", "image_url", "input_audio", "x"]) | scalars},
    optional={"text": scalars, "image_url": json_values},
)
contents = scalars | st.lists(parts | json_values, max_size=3)
messages_ = st.fixed_dictionaries(
    {},
    optional={
        "role": roles,
        "content": contents,
        "name": scalars,
        "tool_call_id": scalars,
        "tool_calls": json_values,
        "extra": json_values,
    },
)
messages_values = st.lists(messages_ | json_values, max_size=4) | json_values


@pytest.fixture
def auth():  # one key for the whole hypothesis run of the test
    no_engine_workers()
    user = User.objects.create_user("chat-fuzz", password="pw-long-enough-1")
    return {"Authorization": f"Bearer {create_api_key(user)[1]}", "content-type": "application/json"}


@FUZZ
@given(messages=messages_values)
def test_any_messages_value_is_a_named_400_or_passes_on(auth, messages):
    body = json.dumps({"model": "any", "max_tokens": 4, "messages": messages})
    response = call("POST", "/v1/chat/completions", content=body, headers=auth)
    error = response.json()["error"] if response.status_code >= 400 else None
    assert response.status_code in (400, 404, 503) and is_envelope(response.json()), response.text[:300]
    if response.status_code == 400:
        assert (error["param"] or "").startswith("messages"), error
    else:  # past validation: the model check (404) or the missing engine (503)
        assert error["code"] in ("model_not_found", "engine_unavailable"), error
