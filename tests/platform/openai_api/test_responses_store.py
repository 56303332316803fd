"""The stored copy of a response on the suite's database (PostgreSQL in make test, whose jsonb cannot hold \\u0000)."""

import pytest

from openai_api.responses_store import store_response, stored_response

pytestmark = pytest.mark.django_db


def test_a_nul_in_the_input_or_the_output_is_stored_as_u_fffd(django_user_model):
    user = django_user_model.objects.create_user("storer", password="x")
    body = {"id": "resp_nul", "model": "tiny", "output": [{"type": "message", "content": [{"text": "o\x00k"}]}]}
    store_response(user=user, body=body, conversation=[{"role": "user", "content": "a\x00b"}])
    stored = stored_response(user=user, response_id="resp_nul")
    assert stored.body["output"][0]["content"][0]["text"] == "o\ufffdk"
    assert stored.conversation == [{"role": "user", "content": "a\ufffdb"}]
