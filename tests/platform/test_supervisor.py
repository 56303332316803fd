"""The process supervisor behind `make run`, with real child processes."""

import io
import os
import signal
import sys
import threading
import time

from tessera.supervisor import Exited, RestartPolicy, Supervisor

PY = sys.executable


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is dead for our purposes (it only waits for its parent to reap it).
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _wait_for(predicate, timeout=10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return False


def test_child_output_is_prefixed_with_its_name():
    out = io.StringIO()
    sup = Supervisor(out=out)
    child = sup.start("hello", [PY, "-c", "print('one'); print('two')"])
    child.process.wait(10)
    sup.stop()
    lines = out.getvalue().splitlines()
    assert "hello    | one" in lines and "hello    | two" in lines


def test_a_crashed_child_is_reported_by_name_and_code():
    sup = Supervisor(out=io.StringIO())
    sup.start("steady", [PY, "-c", "import time; time.sleep(60)"])
    sup.start("crasher", [PY, "-c", "import time, sys; time.sleep(0.3); sys.exit(3)"])
    try:
        exited = sup.watch(poll_seconds=0.05)
    finally:
        sup.stop()
    assert exited == Exited("crasher", 3)
    assert exited.describe() == "crasher exited with code 3"
    assert Exited("x", -signal.SIGKILL).describe() == "x was killed by signal 9"


def test_stop_terminates_children_and_their_grandchildren():
    out = io.StringIO()
    sup = Supervisor(out=out)
    # A parent that spawns a grandchild and prints its pid, the way celery forks its pool.
    spawn = (
        "import subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']);"
        " print(p.pid, flush=True); time.sleep(60)"
    )
    parent = sup.start("parent", [PY, "-c", spawn])
    assert _wait_for(lambda: "parent   | " in out.getvalue())
    grandchild = int(out.getvalue().split("|")[1].strip())
    assert _alive(parent.pid) and _alive(grandchild)
    sup.stop()
    assert not _alive(parent.pid)
    assert _wait_for(lambda: not _alive(grandchild))


def test_a_child_that_ignores_sigterm_is_killed_after_the_grace_period():
    out = io.StringIO()
    sup = Supervisor(out=out, grace_seconds=0.5)
    stubborn = sup.start(
        "stubborn",
        [
            PY,
            "-c",
            "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN);"
            " print('up', flush=True); time.sleep(60)",
        ],
    )
    assert _wait_for(lambda: "up" in out.getvalue())
    started = time.monotonic()
    sup.stop()
    assert time.monotonic() - started < 5
    assert stubborn.process.returncode == -signal.SIGKILL
    assert "stubborn did not stop within 0.5s; killing it" in out.getvalue()


def test_watch_returns_none_when_the_condition_holds():
    sup = Supervisor(out=io.StringIO())
    sup.start("sleeper", [PY, "-c", "import time; time.sleep(60)"])
    try:
        assert sup.watch(poll_seconds=0.05, until=lambda: True) is None
    finally:
        sup.stop()


def test_lower_tiers_are_stopped_after_higher_ones():
    out = io.StringIO()
    sup = Supervisor(out=out)
    # Each child prints when SIGTERM arrives; the base tier must hear it last.
    handler = (
        "import signal, sys, time; signal.signal(signal.SIGTERM, lambda *a: (print('{}', flush=True), sys.exit(0)));"
        " print('up', flush=True); time.sleep(60)"
    )
    sup.start("base", [PY, "-c", handler.format("base-term")], tier=0)
    sup.start("svc", [PY, "-c", handler.format("svc-term")])
    assert _wait_for(lambda: out.getvalue().count("up") == 2)
    sup.stop()
    text = out.getvalue()
    assert text.index("svc-term") < text.index("base-term")


def test_hurry_cuts_the_grace_period_short():
    out = io.StringIO()
    sup = Supervisor(out=out, grace_seconds=30)
    stubborn = sup.start(
        "stubborn",
        [
            PY,
            "-c",
            "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN);"
            " print('up', flush=True); time.sleep(60)",
        ],
    )
    assert _wait_for(lambda: "up" in out.getvalue())
    threading.Timer(0.3, sup.hurry).start()  # the second Ctrl-C, while stop() waits
    started = time.monotonic()
    sup.stop()
    assert time.monotonic() - started < 5
    assert stubborn.process.returncode == -signal.SIGKILL
    assert "stubborn did not stop in time; killing it" in out.getvalue()


# -- restarts ---------------------------------------------------------------------------------


def _starts(path) -> list[float]:
    """The wall-clock start times a child appended to path, one line per start."""
    return [float(line) for line in path.read_text().split()] if path.exists() else []


def _recording_child(path, then: str) -> list[str]:
    """A child that appends its start time to path, then runs `then`."""
    return [PY, "-c", f"import sys, time; open({str(path)!r}, 'a').write(f'{{time.time()}}\\n'); {then}"]


def test_a_killed_child_is_restarted_and_the_others_keep_running():
    out = io.StringIO()
    sup = Supervisor(out=out)
    policy = RestartPolicy(backoff_s=0.1)
    steady = sup.start("steady", [PY, "-c", "import time; time.sleep(60)"])
    engine = sup.start("engine", [PY, "-c", "print('up', flush=True); import time; time.sleep(60)"], restart=policy)
    try:
        assert _wait_for(lambda: "up" in out.getvalue())
        first = engine.pid
        os.kill(first, signal.SIGKILL)
        assert (
            sup.watch(poll_seconds=0.05, until=lambda: engine.restarts == 1 and out.getvalue().count("up") == 2) is None
        )
        assert engine.pid != first and engine.running() and steady.running()
        assert "engine was killed by signal 9; restarting it in 0.1s" in out.getvalue()
        assert "engine restarted (restart 1)" in out.getvalue()
    finally:
        sup.stop()
    assert not engine.running() and not steady.running()


def test_fast_failures_back_off_and_then_give_up_with_a_clear_message(tmp_path):
    out = io.StringIO()
    sup = Supervisor(out=out)
    policy = RestartPolicy(backoff_s=0.2, max_backoff_s=0.4, min_uptime_s=30, max_fast_failures=4)
    log = tmp_path / "starts"
    sup.start("crasher", _recording_child(log, "sys.exit(3)"), restart=policy)
    try:
        exited = sup.watch(poll_seconds=0.02)
    finally:
        sup.stop()
    assert exited == Exited("crasher", 3, fast_failures=4)
    assert exited.describe() == (
        "crasher exited with code 3 (4 times in a row, each soon after starting; not restarting it again)"
    )
    starts = _starts(log)
    assert len(starts) == 4  # the first start and three restarts
    gaps = [b - a for a, b in zip(starts, starts[1:])]
    assert [round(policy.delay(n), 2) for n in (1, 2, 3)] == [0.2, 0.4, 0.4]  # doubled, then capped
    assert all(gap >= policy.delay(n) for n, gap in enumerate(gaps, start=1)), gaps


def test_a_child_that_ran_long_enough_is_restarted_without_counting_towards_giving_up(tmp_path):
    sup = Supervisor(out=io.StringIO())
    policy = RestartPolicy(backoff_s=0.05, min_uptime_s=0.3, max_fast_failures=2)
    log = tmp_path / "starts"
    child = sup.start("flaky", _recording_child(log, "time.sleep(0.5); sys.exit(1)"), restart=policy)
    try:
        assert (
            sup.watch(
                poll_seconds=0.02,
                until=lambda: len(_starts(log)) >= 4,
            )
            is None
        )
    finally:
        sup.stop()
    assert child.restarts >= 3 and child.fast_failures == 0


def test_what_is_left_of_a_dead_childs_group_is_killed_before_the_restart():
    out = io.StringIO()
    sup = Supervisor(out=out)
    spawn = (
        "import subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']);"
        " print(p.pid, flush=True); time.sleep(60)"
    )
    parent = sup.start("worker", [PY, "-c", spawn], restart=RestartPolicy(backoff_s=0.1))
    try:
        assert _wait_for(lambda: "worker   | " in out.getvalue())
        orphan = int(out.getvalue().split("|")[1].split()[0])
        os.kill(parent.pid, signal.SIGKILL)  # the way `kill -9` hits Celery's main process
        assert sup.watch(poll_seconds=0.05, until=lambda: parent.restarts == 1) is None
        assert _wait_for(lambda: not _alive(orphan))
    finally:
        sup.stop()


def test_on_exit_is_called_once_per_death_with_the_dead_process():
    sup = Supervisor(out=io.StringIO())
    dead = []
    child = sup.start(
        "engine",
        [PY, "-c", "import time; time.sleep(60)"],
        restart=RestartPolicy(backoff_s=0.1),
        on_exit=lambda c: dead.append(c.pid),
    )
    try:
        first = child.pid
        os.kill(first, signal.SIGKILL)
        assert sup.watch(poll_seconds=0.02, until=lambda: child.restarts == 1) is None
        os.kill(child.pid, signal.SIGKILL)
        second = child.pid
        assert sup.watch(poll_seconds=0.02, until=lambda: child.restarts == 2) is None
    finally:
        sup.stop()
    assert dead == [first, second]
