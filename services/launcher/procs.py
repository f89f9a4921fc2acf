"""Child processes that die with their parent and announce readiness with one stdout line."""

from __future__ import annotations

import contextlib
import ctypes
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

log = logging.getLogger(__name__)

READY_PREFIX = "TANDEM_READY "
TAIL_LINES = 20   # of a child's output, kept to say why it died before it was ready
_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    # Linux: the kernel SIGKILLs the child when the launcher dies, even by SIGKILL: no orphans
    # holding ports, shared memory or Redis after a crash.
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:
        pass
    os.setsid()  # own process group: a terminal's Ctrl-C reaches the launcher only, which stops us in order


@dataclass
class Child:
    name: str
    argv: list[str]
    env: dict[str, str] | None = None
    proc: subprocess.Popen | None = None
    ready: dict | None = None
    ready_event: threading.Event = field(default_factory=threading.Event)
    on_line: Callable[[str, str], None] | None = None
    tail: deque[str] = field(default_factory=lambda: deque(maxlen=TAIL_LINES))
    started_at: float = 0.0
    _capture: list[str] | None = field(default=None, repr=False)   # lines kept by dump_stacks

    def start(self) -> None:
        self.started_at = time.monotonic()
        self.proc = subprocess.Popen(
            self.argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
            env=self.env, preexec_fn=_die_with_parent,
        )
        threading.Thread(target=self._pump, name=f"log-{self.name}", daemon=True).start()

    def _pump(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        for line in self.proc.stdout:
            line = line.rstrip("\n")
            if line.startswith(READY_PREFIX) and self.ready is None:
                self.ready = json.loads(line[len(READY_PREFIX):])
                self.ready_event.set()
            else:
                self.tail.append(line)
                if self._capture is not None:
                    self._capture.append(line)
            if self.on_line is not None:
                self.on_line(self.name, line)
        self.ready_event.set()  # EOF: the process died; waiters must look at `alive`

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def wait_ready(self, timeout: float) -> dict:
        """The READY line's JSON. Raises RuntimeError saying whether the child exited (with its exit code)
        or is still starting, with its last lines of output."""
        if self.ready_event.wait(timeout) and self.ready is not None:
            return self.ready
        if self.proc is None:
            raise RuntimeError(f"{self.name} was never started")
        try:
            code = self.proc.wait(5.0) if self.ready_event.is_set() else self.proc.poll()   # EOF: it is exiting
        except subprocess.TimeoutExpired:
            code = None
        waited = time.monotonic() - self.started_at
        if code is None:
            what = f"{self.name} did not become ready within {waited:.0f}s (still running)"
        else:
            what = f"{self.name} exited with code {code} before it was ready ({waited:.0f}s after it started)"
        tail = "\n".join(f"  {line}" for line in self.tail)
        raise RuntimeError(what + (f"; its last lines:\n{tail}" if tail else "; it printed nothing"))

    def terminate(self) -> None:
        if self.alive:
            self.proc.send_signal(signal.SIGTERM)

    def dump_stacks(self, wait_s: float) -> list[str]:
        """Ask the child to print its threads' stacks and give it `wait_s` to do so; returns what it
        printed meanwhile (also when `--quiet` forwards none of its lines)."""
        if not self.alive:
            return []
        self._capture = []
        with contextlib.suppress(ProcessLookupError):
            self.proc.send_signal(STACK_DUMP_SIGNAL)
        self.wait(wait_s)
        lines, self._capture = self._capture, None
        return lines

    def kill(self) -> None:
        if self.alive:
            self.proc.kill()

    def wait(self, timeout: float) -> bool:
        if self.proc is None:
            return True
        try:
            self.proc.wait(timeout)
            return True
        except subprocess.TimeoutExpired:
            return False


STACK_DUMP_SIGNAL = signal.SIGUSR1   # workers print every thread's stack on it (faulthandler)
STACK_DUMP_WAIT_S = 1.0


def stop_all(children: list[Child], grace_s: float = 10.0) -> None:
    """SIGTERM everyone (router first, so no new work arrives), wait, then SIGKILL stragglers: each
    first prints where its threads are (its log says why the stop hung), and what a killed worker
    leaves in /dev/shm is removed, as its successor would at start."""
    for c in children:
        c.terminate()
    deadline = time.monotonic() + grace_s
    killed = False
    for c in children:
        if not c.wait(max(0.0, deadline - time.monotonic())):
            stacks = c.dump_stacks(STACK_DUMP_WAIT_S)
            log.warning("%s did not stop within %.0fs: killing it. Where its threads were:\n%s",
                        c.name, grace_s, "\n".join(stacks) or "(it printed nothing)")
            c.kill()
            c.wait(5.0)
            killed = True
    if killed:   # imported here: the launcher itself needs no transfer code
        from tandem.kvtransfer.protocol.shm import cleanup_stale_segments
        for path in cleanup_stale_segments():
            log.info("removed %s, left by a killed worker", path)


def python_cmd(*args: str) -> list[str]:
    return [sys.executable, "-P", "-m", "tandem.cli", *args]


def niced(argv: list[str], niceness: int) -> list[str]:
    """`argv` run at `niceness` (coreutils `nice`, which execs it: the pid is the command's); as is at 0."""
    if not niceness:
        return argv
    exe = shutil.which("nice")
    if exe is None:
        log.warning("no `nice` on PATH: %s runs at the workers' priority", os.path.basename(argv[0]))
        return argv
    return [exe, "-n", str(niceness), *argv]
