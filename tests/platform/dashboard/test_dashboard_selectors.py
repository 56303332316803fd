"""Selectors against generated usage: sums and percentiles equal what the raw usage rows say.

Expected values are computed here straight from usage.UsageRecord rows (plain Python and numpy),
never through the dashboard's roll-up or histogram code.
"""

from collections import defaultdict
from datetime import timedelta

import numpy as np
import pytest
from dashboard_testing import NOW

from dashboard import selectors, services
from dashboard.histogram import RELATIVE_ACCURACY
from dashboard.models import UsageHourly
from usage.models import UsageRecord

pytestmark = pytest.mark.usefixtures("generated_usage")


def _raw():
    return list(
        UsageRecord.objects.values(
            "created_at",
            "user_id",
            "api_key_id",
            "model",
            "source",
            "status_code",
            "prompt_tokens",
            "completion_tokens",
            "ttft_ms",
            "latency_ms",
        )
    )


def _bucket(moment, bucket):
    moment = moment.replace(minute=0, second=0, microsecond=0)
    return moment.replace(hour=0) if bucket == "day" else moment


def _expected_sums(rows, key):
    out = defaultdict(lambda: defaultdict(int))
    for r in rows:
        s = out[key(r)]
        s["requests"] += 1
        s["prompt_tokens"] += r["prompt_tokens"]
        s["completion_tokens"] += r["completion_tokens"]
        s["errors"] += r["status_code"] >= 400
        s["rate_limited"] += r["status_code"] == 429
    return out


def _lower_percentile(values, q):
    return float(np.percentile(values, q, method="lower")) if values else None


def _close(got, expected):
    if expected is None:
        return got is None
    # The histogram's relative accuracy, plus the 0.01 ms the selectors round to.
    return abs(got - expected) <= RELATIVE_ACCURACY * expected + 0.01


def _roll_up_at(moment):
    services.reset_rollups()
    services.roll_up_usage(now=moment)


@pytest.mark.parametrize("range_key,bucket", [("7d", "hour"), ("30d", "day")])
def test_usage_over_time_sums_equal_raw_rows(range_key, bucket):
    _roll_up_at(NOW - timedelta(hours=5))  # part from roll-ups, the last hours live
    window = selectors.window_for(range_key, bucket, now=NOW)
    expected = _expected_sums(_raw(), lambda r: _bucket(r["created_at"], bucket))
    got = selectors.usage_over_time(window)
    assert len(got) == len(window.buckets())
    assert sum(b["requests"] for b in got) == UsageRecord.objects.count() > 1000
    for at, b in zip(window.buckets(), got):
        e = expected.get(at, {})
        for field in ("requests", "prompt_tokens", "completion_tokens", "errors", "rate_limited"):
            assert b[field] == e.get(field, 0), (b["t"], field)
    assert any(b["rate_limited"] for b in got) and any(b["errors"] > b["rate_limited"] for b in got)


def test_answers_do_not_depend_on_the_rollup_watermark():
    window = selectors.window_for("7d", "hour", now=NOW)

    def snapshot():
        return (
            selectors.usage_over_time(window),
            selectors.latency_over_time(window),
            selectors.breakdown(window, "model"),
            selectors.top_api_keys(window),
            selectors.totals(window),
        )

    services.reset_rollups()
    all_live = snapshot()
    _roll_up_at(NOW - timedelta(hours=30))
    partly = snapshot()
    _roll_up_at(NOW + timedelta(hours=2))
    assert UsageHourly.objects.exists()
    all_rolled = snapshot()
    assert all_live == partly == all_rolled


def test_latency_percentiles_per_day_match_numpy():
    _roll_up_at(NOW - timedelta(hours=5))
    window = selectors.window_for("30d", "day", now=NOW)
    served = [r for r in _raw() if r["status_code"] < 400]
    by_day = defaultdict(lambda: defaultdict(list))
    for r in served:
        day = by_day[_bucket(r["created_at"], "day")]
        day["ttft"].append(r["ttft_ms"])
        day["latency"].append(r["latency_ms"])
        if r["completion_tokens"] >= 2:
            day["tpot"].append((r["latency_ms"] - r["ttft_ms"]) / (r["completion_tokens"] - 1))
    checked = 0
    for at, point in zip(window.buckets(), selectors.latency_over_time(window)):
        for metric in ("ttft", "tpot", "latency"):
            for q in (50, 95, 99):
                expected = _lower_percentile(by_day[at][metric], q)
                assert _close(point[metric][f"p{q}"], expected), (at, metric, q, point[metric], expected)
                checked += expected is not None
    assert checked >= 3 * 3 * 3  # at least three days of data were compared


def test_overall_totals_and_latency_match_raw_rows():
    _roll_up_at(NOW - timedelta(hours=1))
    window = selectors.window_for("7d", "hour", now=NOW)
    rows = _raw()
    served = [r for r in rows if r["status_code"] < 400]
    got = selectors.totals(window)
    assert got["requests"] == len(rows)
    assert got["prompt_tokens"] == sum(r["prompt_tokens"] for r in rows)
    assert got["completion_tokens"] == sum(r["completion_tokens"] for r in rows)
    assert got["error_rate"] == round(sum(r["status_code"] >= 400 for r in rows) / len(rows), 4)
    assert got["rate_limited_rate"] == round(sum(r["status_code"] == 429 for r in rows) / len(rows), 4)
    for q in (50, 95, 99):
        assert _close(got["latency"]["latency"][f"p{q}"], _lower_percentile([r["latency_ms"] for r in served], q))
        assert _close(got["latency"]["ttft"][f"p{q}"], _lower_percentile([r["ttft_ms"] for r in served], q))
    assert got["latency"]["ttft"]["mean"] == pytest.approx(np.mean([r["ttft_ms"] for r in served]), abs=0.01)


@pytest.mark.parametrize("dim", ["model", "source"])
def test_breakdown_by_model_and_source(dim):
    _roll_up_at(NOW - timedelta(hours=3))
    window = selectors.window_for("7d", "hour", now=NOW)
    expected = _expected_sums(_raw(), lambda r: r[dim])
    got = selectors.breakdown(window, dim)
    assert {r[dim] for r in got} == set(expected)
    for r in got:
        assert r["requests"] == expected[r[dim]]["requests"]
        assert r["total_tokens"] == expected[r[dim]]["prompt_tokens"] + expected[r[dim]]["completion_tokens"]
    totals = [r["total_tokens"] for r in got]
    assert totals == sorted(totals, reverse=True)
    if dim == "source":
        assert set(expected) == {"api", "playground", "batch"}


def test_top_users_and_top_api_keys():
    _roll_up_at(NOW - timedelta(hours=3))
    window = selectors.window_for("7d", "hour", now=NOW)
    rows = _raw()
    by_user = _expected_sums(rows, lambda r: r["user_id"])
    user_tokens = sorted(((s["prompt_tokens"] + s["completion_tokens"], u) for u, s in by_user.items()), reverse=True)
    top = selectors.top_users(window, limit=3)
    assert [(r["total_tokens"], r["user_id"]) for r in top] == user_tokens[:3]
    assert all(r["username"].startswith("demo-user-") for r in top)

    by_key = _expected_sums([r for r in rows if r["api_key_id"]], lambda r: r["api_key_id"])
    keys = selectors.top_api_keys(window, limit=50)
    assert {r["api_key_id"]: r["requests"] for r in keys} == {k: s["requests"] for k, s in by_key.items()}
    assert all(r["label"].startswith("tsk-") or "…" in r["label"] for r in keys)


def test_user_drilldown_counts_only_that_user():
    _roll_up_at(NOW - timedelta(hours=3))
    window = selectors.window_for("7d", "hour", now=NOW)
    rows = _raw()
    user_id = rows[0]["user_id"]
    mine = [r for r in rows if r["user_id"] == user_id]
    from django.contrib.auth import get_user_model

    data = selectors.user_drilldown(get_user_model().objects.get(pk=user_id), window)
    assert data["totals"]["requests"] == len(mine)
    assert sum(b["requests"] for b in data["over_time"]) == len(mine)
    assert sum(r["requests"] for r in data["by_source"]) == len(mine)
    assert data["user"]["id"] == user_id


def test_rollup_is_idempotent_and_picks_up_late_rows():
    at = NOW - timedelta(hours=6)
    _roll_up_at(at)
    first = list(
        UsageHourly.objects.order_by("hour", "user_id", "api_key_id", "model", "source").values_list(
            "hour", "user_id", "api_key_id", "model", "source", "requests", "prompt_tokens", "latency_hist"
        )
    )
    services.roll_up_usage(now=at)
    services.roll_up_usage(now=at)
    again = list(
        UsageHourly.objects.order_by("hour", "user_id", "api_key_id", "model", "source").values_list(
            "hour", "user_id", "api_key_id", "model", "source", "requests", "prompt_tokens", "latency_hist"
        )
    )
    assert again == first and len(first) > 50

    # A long request recorded after its hour was rolled up: the lookback rebuilds that hour.
    late_hour = services.floor_hour(at) - timedelta(hours=1)
    template = UsageRecord.objects.first()
    before = sum(UsageHourly.objects.filter(hour=late_hour).values_list("requests", flat=True))
    late = UsageRecord.objects.create(
        user_id=template.user_id,
        source="api",
        model="late-model",
        prompt_tokens=5,
        completion_tokens=5,
        ttft_ms=10,
        latency_ms=100,
    )
    UsageRecord.objects.filter(pk=late.pk).update(created_at=late_hour + timedelta(minutes=59))
    services.roll_up_usage(now=at)
    after = sum(UsageHourly.objects.filter(hour=late_hour).values_list("requests", flat=True))
    assert after == before + 1
    assert UsageHourly.objects.filter(hour=late_hour, model="late-model").count() == 1


def test_users_near_and_over_quota():
    from django.contrib.auth import get_user_model

    from quotas.models import Plan, UserPlan

    _roll_up_at(NOW - timedelta(hours=3))
    User = get_user_model()
    users = list(User.objects.filter(username__startswith="demo-user-").order_by("username"))
    tokens_today = {}
    day_start = NOW.replace(hour=0, minute=0, second=0, microsecond=0)
    for r in _raw():
        if r["created_at"] >= day_start:
            tokens_today[r["user_id"]] = tokens_today.get(r["user_id"], 0) + r["prompt_tokens"] + r["completion_tokens"]
    over, near, fine = users[0], users[1], users[2]
    for user, budget in (
        (over, tokens_today[over.pk] // 2),
        (near, int(tokens_today[near.pk] / 0.9)),
        (fine, tokens_today[fine.pk] * 10),
    ):
        plan = Plan.objects.create(name=f"p-{user.pk}", tokens_per_day=budget)
        UserPlan.objects.create(user=user, plan=plan)
    unlimited = Plan.objects.create(name="unlimited")
    for user in users[3:]:
        UserPlan.objects.create(user=user, plan=unlimited)

    rows = {r["username"]: r for r in selectors.users_near_quota(threshold=0.8, now=NOW)}
    assert set(rows) == {over.username, near.username}
    assert rows[over.username]["state"] == "over" and rows[over.username]["tokens_today"] == tokens_today[over.pk]
    assert rows[near.username]["state"] == "near"
    assert rows[near.username]["day_used"] == pytest.approx(0.9, abs=0.01)
