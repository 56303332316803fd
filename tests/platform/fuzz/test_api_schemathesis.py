"""schemathesis against /v1/openapi.json, in process through the real ASGI app: no 5xx, every error in the envelope.

No engine worker runs here, so a request that passes every check answers 503 engine_unavailable (documented);
everything before it (parsing, validation, auth, quotas) is what this fuzzes.
"""

from __future__ import annotations

import os

import pytest
import schemathesis
from django.contrib.auth.models import User
from hypothesis import HealthCheck, settings

from accounts.services import create_api_key
from tests.platform.fuzz.fuzz_checks import check_response
from tests.platform.security.asgi_calls import no_engine_workers

pytestmark = pytest.mark.django_db(transaction=True)
MAX_EXAMPLES = int(os.environ.get("FUZZ_MAX_EXAMPLES", 25))
EXPECTED_5XX = frozenset({(503, "engine_unavailable")})  # no worker in this process


def _schema():
    from tessera.asgi import application

    return schemathesis.openapi.from_asgi("/v1/openapi.json", application)


schema = _schema()  # at collection: pytest-django has set Django up, and the schema view reads no database


@pytest.fixture
def auth():
    no_engine_workers()
    user = User.objects.create_user("fuzz", password="pw-long-enough-1")
    return {"Authorization": f"Bearer {create_api_key(user)[1]}"}


@schema.parametrize()
@settings(
    max_examples=MAX_EXAMPLES,
    derandomize=os.environ.get("FUZZ_RANDOM") != "1",
    deadline=None,
    suppress_health_check=list(HealthCheck),
)
def test_no_5xx_and_errors_in_the_envelope(case, auth):
    response = case.call(headers=auth)
    check_response(case, response, EXPECTED_5XX)
