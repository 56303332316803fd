"""The bookkeeping thread's lanes (generation/lanes.py): users taken in turn, each lane in order."""

import threading

import pytest

from generation.lanes import FairLanes


def blocked_lanes():
    """Lanes whose thread is held inside a first job of lane "flood" until the returned event is set."""
    lanes, started, release = FairLanes("test-lanes"), threading.Event(), threading.Event()
    lanes.submit("flood", lambda: (started.set(), release.wait(10)))
    assert started.wait(10)
    return lanes, release


def test_another_users_job_waits_for_one_job_of_a_flood_not_for_all_of_it():
    lanes, release = blocked_lanes()
    ran = []
    floods = [lanes.submit("flood", lambda i=i: ran.append(("flood", i))) for i in range(20)]
    other = lanes.submit("other", lambda: ran.append(("other", 0)))
    release.set()
    other.result(10)
    for future in floods:
        future.result(10)
    assert ran.index(("other", 0)) == 1  # after the flood's next job, not its twentieth
    assert [i for lane, i in ran if lane == "flood"] == list(range(20))  # a lane keeps its order


def test_a_job_cancelled_before_its_turn_never_runs_and_errors_reach_the_caller():
    lanes, release = blocked_lanes()
    ran = []
    cancelled = lanes.submit("a", lambda: ran.append("cancelled"))
    assert cancelled.cancel()
    failing = lanes.submit("a", lambda: 1 / 0)
    release.set()
    with pytest.raises(ZeroDivisionError):
        failing.result(10)
    assert lanes.submit("a", lambda: "after").result(10) == "after"  # the thread goes on
    assert ran == []
    assert lanes.thread is not None and lanes.thread.name == "test-lanes"
