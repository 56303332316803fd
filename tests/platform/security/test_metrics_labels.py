"""/metrics has a bounded label set: no method name or path a client sends becomes a new series."""

from __future__ import annotations

import secrets

import pytest
from django.urls import get_resolver
from prometheus_client.parser import text_string_to_metric_families

from common import http_guards
from tests.platform.security.asgi_calls import call

pytestmark = pytest.mark.django_db(transaction=True)


def _series() -> set[tuple[str, str, str]]:
    families = text_string_to_metric_families(call("GET", "/metrics").text)
    return {
        (s.labels["route"], s.labels["method"], s.labels["status"])
        for family in families
        for s in family.samples
        if s.name == "tessera_http_requests_total"
    }


def _route_templates(patterns=None, prefix="/") -> set[str]:
    """Every route template of the URL conf (what the route label may be)."""
    templates = set()
    for entry in patterns if patterns is not None else get_resolver().url_patterns:
        if hasattr(entry, "url_patterns"):
            templates |= _route_templates(entry.url_patterns, prefix + str(entry.pattern))
        else:
            templates.add(prefix + str(entry.pattern))
    return templates


def test_random_methods_and_paths_add_no_series():
    call("GET", "/v1/models")  # at least one known series exists before
    before = _series()
    for _ in range(40):
        method = "X" + secrets.token_hex(4).upper()
        call(method, f"/v1/{secrets.token_hex(6)}")
        call(method, "/v1/models")
        call("GET", f"/v1/models/{secrets.token_hex(6)}")
        call("GET", f"/v1/files/{secrets.token_hex(6)}")
    after = _series()
    assert {route for route, _m, _s in after} <= _route_templates() | {"unmatched"}
    assert {method for _r, method, _s in after} <= http_guards.KNOWN_METHODS | {"other"}
    # 160 requests with 40 new method names and 120 new paths: a handful of series at most.
    assert len(after - before) <= 6, sorted(after - before)
    assert ("unmatched", "other", "404") in after and ("/v1/models", "other", "405") in after


def test_the_route_label_is_the_template_not_the_path():
    model = "some-" + secrets.token_hex(4)
    call("GET", f"/v1/models/{model}")
    labels = call("GET", "/metrics").text
    assert model not in labels and 'route="/v1/models/<path:model>"' in labels
