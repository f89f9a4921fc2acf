"""The supervisor restarts a dead child with backoff, says why it died, counts, and gives up."""

from __future__ import annotations

import sys
import time

import pytest

from tandem.services.launcher.procs import Child
from tandem.services.launcher.supervisor import Supervisor, describe_exit

SCRIPT = "import json, os, time; print('TANDEM_READY ' + json.dumps({'pid': os.getpid()}), flush=True); time.sleep(60)"


def sleeper(name: str = "w") -> Child:
    child = Child(name, [sys.executable, "-c", SCRIPT])
    child.start()
    return child


def poll_until(sup: Supervisor, pred, timeout: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            return False
        sup.poll()
        time.sleep(0.02)
    return True


def test_exit_status_in_words():
    assert describe_exit(-9) == "killed by SIGKILL"
    assert describe_exit(3) == "code 3"


def test_a_killed_child_comes_back_counted_and_announced(caplog):
    announced = []
    sup = Supervisor(backoff_s=0.05, max_backoff_s=0.2, on_ready=lambda n, r, ready: announced.append((n, r, ready)))
    first = sleeper()
    other = sleeper("other")
    try:
        sup.add("w", first, lambda: sleeper())
        sup.add("other", other, lambda: sleeper("other"))
        assert first.wait_ready(20)
        for round_ in (1, 2):
            sup.entries["w"].child.kill()
            assert poll_until(sup, lambda r=round_: len(announced) == r)
            assert sup.restarts() == {"w": round_, "other": 0}
        assert announced[-1][0] == "w" and announced[-1][2]["pid"] == sup.entries["w"].child.proc.pid
        assert sup.entries["other"].child is other and other.alive    # the rest keep running
        assert "w exited (killed by SIGKILL); restarting it in 0.1s (restart 2)" in caplog.text
    finally:
        for e in sup.entries.values():
            e.child.kill()


def test_a_clean_exit_was_on_purpose_and_is_not_restarted():
    sup = Supervisor(backoff_s=0.01)
    child = Child("q", [sys.executable, "-c", "pass"])
    child.start()
    sup.add("q", child, lambda: pytest.fail("restarted a process that exited 0"))
    assert poll_until(sup, lambda: sup.stopped == ["q"])
    for _ in range(5):
        sup.poll()
    assert sup.restarts() == {"q": 0} and sup.gave_up == []


def test_gives_up_after_max_restarts():
    sup = Supervisor(backoff_s=0.01, max_restarts=1)
    quitter = lambda: Child("q", [sys.executable, "-c", "raise SystemExit(4)"])  # noqa: E731
    child = quitter()
    child.start()
    sup.add("q", child, lambda: (c := quitter(), c.start(), c)[2])
    assert poll_until(sup, lambda: sup.gave_up == ["q"])
    assert sup.restarts() == {"q": 1} and sup.entries["q"].last_exit == 4
