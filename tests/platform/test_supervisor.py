"""The process supervisor behind `make run`, with real child processes."""
import io
import os
import signal
import sys
import threading
import time

from tessera.supervisor import Exited, Supervisor

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
    spawn = ("import subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']);"
             " print(p.pid, flush=True); time.sleep(60)")
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
    stubborn = sup.start("stubborn", [PY, "-c", "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN);"
                                                 " print('up', flush=True); time.sleep(60)"])
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
    handler = ("import signal, sys, time; signal.signal(signal.SIGTERM, lambda *a: (print('{}', flush=True), sys.exit(0)));"
               " print('up', flush=True); time.sleep(60)")
    sup.start("base", [PY, "-c", handler.format("base-term")], tier=0)
    sup.start("svc", [PY, "-c", handler.format("svc-term")])
    assert _wait_for(lambda: out.getvalue().count("up") == 2)
    sup.stop()
    text = out.getvalue()
    assert text.index("svc-term") < text.index("base-term")


def test_hurry_cuts_the_grace_period_short():
    out = io.StringIO()
    sup = Supervisor(out=out, grace_seconds=30)
    stubborn = sup.start("stubborn", [PY, "-c", "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN);"
                                                 " print('up', flush=True); time.sleep(60)"])
    assert _wait_for(lambda: "up" in out.getvalue())
    threading.Timer(0.3, sup.hurry).start()  # the second Ctrl-C, while stop() waits
    started = time.monotonic()
    sup.stop()
    assert time.monotonic() - started < 5
    assert stubborn.process.returncode == -signal.SIGKILL
    assert "stubborn did not stop in time; killing it" in out.getvalue()
