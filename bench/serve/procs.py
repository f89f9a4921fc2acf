"""Child processes of `tandem bench sweep`: each in its own session, output kept for error messages,
stopped gracefully and then as a whole process group."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
UP_PREFIX = "TANDEM_UP "      # `tandem up --ready-json`'s summary line


class _Proc:
    """A child process in its own session whose output is kept (last lines) for error messages."""

    def __init__(self, argv: list[str], env: dict[str, str] | None = None, on_line: Callable[[str], None] | None = None,
                 cwd: str | Path = ROOT):
        self.argv = argv
        self.log: deque[str] = deque(maxlen=200)
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=cwd,
                                     env=env, start_new_session=True)

        def pump() -> None:
            for line in self.proc.stdout:
                self.log.append(line.rstrip())
                if on_line is not None:
                    on_line(line)
        threading.Thread(target=pump, daemon=True).start()

    def tail(self, n: int = 30) -> str:
        return "\n".join(list(self.log)[-n:])

    def stop(self, timeout_s: float = 20.0) -> None:
        stop_process(self.proc, timeout_s)

    def stop_group(self, timeout_s: float = 20.0, grace_s: float = 5.0) -> None:
        """SIGTERM to the whole session (a server and the workers it forked), then SIGKILL to whatever is left,
        also after the leader has exited: no child may outlive the deployment."""
        pgid = self.proc.pid  # start_new_session: the leader's pid is the group id
        _killpg(pgid, signal.SIGTERM)
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            pass
        deadline = time.monotonic() + grace_s
        while _group_alive(pgid) and time.monotonic() < deadline:  # the forked workers shut down too
            time.sleep(0.1)
        _killpg(pgid, signal.SIGKILL)
        self.proc.wait(10)
        deadline = time.monotonic() + 2.0  # SIGKILL is not instant on a busy machine
        while _group_alive(pgid) and time.monotonic() < deadline:
            time.sleep(0.05)


def stop_process(proc: subprocess.Popen, timeout_s: float = 20.0) -> None:
    """SIGTERM first (graceful), then SIGKILL to the whole session of a child started with
    `start_new_session`: uvicorn waits for open streams forever."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


def _group_alive(pgid: int) -> bool:
    """Whether a process of the group still runs (zombies do not count: PID 1 may be slow to reap orphans)."""
    proc = Path("/proc")
    if not proc.is_dir():
        return _killpg(pgid, 0)
    for stat in proc.glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if len(fields) > 2 and fields[2] == str(pgid) and fields[0] != "Z":
            return True
    return False


def _killpg(pgid: int, sig: int) -> bool:
    """Signal a process group; False when no process of it is left."""
    try:
        os.killpg(pgid, sig)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:  # only zombies left (macOS reports them so)
        return False


class UpFailed(RuntimeError):
    """`tandem up` exited or timed out before its summary line; the message ends with its output."""


def start_tandem_up(args: list[str], timeout_s: float, env: dict[str, str] | None = None,
                    on_line: Callable[[str], None] | None = None) -> tuple[_Proc, dict]:
    """`tandem up --ready-json ARGS` as a child in its own session. Returns it and its `TANDEM_UP`
    summary once everything is ready; raises UpFailed (after stopping it) if it exits or `timeout_s`
    passes first. `on_line` sees every output line, the summary included."""
    info: dict = {}
    ready = threading.Event()

    def pump(line: str) -> None:
        at = line.find(UP_PREFIX)
        if at >= 0 and not info:
            info.update(json.loads(line[at + len(UP_PREFIX):]))
            ready.set()
        if on_line is not None:
            on_line(line)

    argv = [sys.executable, "-P", "-m", "tandem.cli", "up", "--ready-json", *args]
    proc = _Proc(argv, env=dict(os.environ if env is None else env, PYTHONUNBUFFERED="1"), on_line=pump)
    deadline = time.monotonic() + timeout_s
    while not ready.wait(0.5):
        if proc.proc.poll() is not None or time.monotonic() > deadline:
            proc.stop()
            raise UpFailed(f"`tandem up {' '.join(args)}` did not come up:\n{proc.tail()}")
    return proc, info
