"""Admission is atomic across processes: two OS processes x 10 threads race against one Redis."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from django.conf import settings

from quotas.ledger import Reservation

WORKER = Path(__file__).with_name("quota_worker.py")
REPO = Path(__file__).resolve().parents[3]


def race(prefix: str, limits: dict, tokens: int = 10, processes: int = 2, threads: int = 10) -> list[dict]:
    """Start `processes` workers that all call reserve() at the same instant; return every outcome."""
    start_at = time.time() + 1.5  # time for both interpreters to start and import
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{REPO / 'platform'}"}
    args = [settings.REDIS_URL, prefix, "7", str(threads), str(tokens), str(start_at), json.dumps(limits)]
    procs = [
        subprocess.Popen([sys.executable, str(WORKER), *args], stdout=subprocess.PIPE, env=env, text=True)
        for _ in range(processes)
    ]
    outcomes = []
    for proc in procs:
        out, _ = proc.communicate(timeout=60)
        assert proc.returncode == 0
        outcomes.extend(json.loads(out))
    assert len(outcomes) == processes * threads
    return outcomes


def admitted(outcomes):
    return [Reservation.from_dict(o["reservation"]) for o in outcomes if o["ok"]]


def test_twenty_concurrent_requests_admit_exactly_five_then_the_minute_window_caps_at_ten(ledger, prefix):
    limits = {"concurrent_requests": 5, "requests_per_minute": 10}

    first = race(prefix, limits)
    assert len(admitted(first)) == 5
    assert {o["limit"] for o in first if not o["ok"]} == {"concurrent_requests"}

    for reservation in admitted(first):  # these five finish: their slots free up
        assert ledger.settle(reservation, 5)
    second = race(prefix, limits)
    assert len(admitted(second)) == 5  # 10 requests this minute now

    for reservation in admitted(second):
        ledger.settle(reservation, 5)
    third = race(prefix, limits)
    assert admitted(third) == []
    refusals = [o for o in third if not o["ok"]]
    assert {o["limit"] for o in refusals} == {"requests_per_minute"}
    assert all(1 <= o["retry_after"] <= 60 for o in refusals)


def test_requests_per_minute_alone_admits_exactly_ten_of_twenty(ledger, prefix):
    outcomes = race(prefix, {"requests_per_minute": 10})
    assert len(admitted(outcomes)) == 10
    assert ledger.usage(7).requests_last_minute == 10


def test_parallel_reservations_never_overdraw_the_token_budget(ledger, prefix):
    # 40 racing requests of 100 tokens against 1,050 tokens a day: exactly 10 fit.
    outcomes = race(prefix, {"tokens_per_day": 1050, "tokens_per_month": 5000}, tokens=100, threads=20)
    granted = admitted(outcomes)
    assert len(granted) == 10
    assert ledger.usage(7).tokens_today == 1000
    assert {o["limit"] for o in outcomes if not o["ok"]} == {"tokens_per_day"}

    for reservation in granted:  # each really used 40 of its 100 reserved tokens
        ledger.settle(reservation, 40)
    assert ledger.usage(7).tokens_today == 400
    assert ledger.usage(7).tokens_this_month == 400
