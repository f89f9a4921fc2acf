"""`tandem up` keeps its processes running: a child that dies is started again, the rest keep serving.

Each supervised process has a `start()` that launches a fresh instance (a worker with its old flags
and id, the router and the gateway on the ports they had, Redis on the same socket). A process that
exits with code 0 was stopped on purpose (SIGTERM, then a clean drain): it is left down and listed
in `stopped`. Any other end is a death, logged with the exit status; the restart waits an exponential backoff (`backoff_s`, doubling up to
`max_backoff_s`, back to `backoff_s` once an instance has run `stable_s`), and each process may be
restarted at most `max_restarts` times (then it stays down and `gave_up` names it). Once a restarted
instance is ready, `on_ready(name, restarts, ready)` is called (the launcher prints a line for scripts).

Single-threaded: the launcher's main loop calls `poll()` a few times a second.
"""

from __future__ import annotations

import logging
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from tandem.services.launcher.procs import Child

log = logging.getLogger(__name__)


def describe_exit(code: int | None) -> str:
    """`code 3` / `killed by SIGKILL`."""
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"code {code}"


@dataclass(eq=False)
class Supervised:
    name: str
    child: Child
    start: Callable[[], Child]                     # launches and returns a fresh instance
    ready_probe: Callable[[Child], bool] = lambda c: c.ready is not None
    restarts: int = 0
    started_at: float = field(default_factory=time.monotonic)
    backoff_s: float = 0.0                         # the next restart's wait
    restart_at: float | None = None                # a death was seen; start again at this time
    last_exit: int | None = None
    announced: bool = True                         # the current instance's readiness was reported


class Supervisor:
    def __init__(self, backoff_s: float = 0.5, max_backoff_s: float = 8.0, stable_s: float = 60.0,
                 max_restarts: int = 20,
                 on_ready: Callable[[str, int, dict], None] = lambda name, restarts, ready: None,
                 clock: Callable[[], float] = time.monotonic):
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self.stable_s = stable_s
        self.max_restarts = max_restarts
        self.on_ready = on_ready
        self.clock = clock
        self.entries: dict[str, Supervised] = {}
        self.gave_up: list[str] = []
        self.stopped: list[str] = []               # exited 0: stopped on purpose, not restarted

    def add(self, name: str, child: Child, start: Callable[[], Child],
            ready_probe: Callable[[Child], bool] | None = None) -> Supervised:
        entry = Supervised(name, child, start, started_at=self.clock(), backoff_s=self.backoff_s)
        if ready_probe is not None:
            entry.ready_probe = ready_probe
        self.entries[name] = entry
        return entry

    def retire(self, name: str) -> Child:
        """Stop supervising `name` (a worker the launcher stops on purpose, e.g. to start another role
        on its cores): it is never restarted nor reported; returns its current instance."""
        return self.entries.pop(name).child

    def restarts(self) -> dict[str, int]:
        return {name: e.restarts for name, e in self.entries.items()}

    def poll(self) -> None:
        now = self.clock()
        for e in self.entries.values():
            if e.restart_at is None and not e.child.alive:
                self._died(e, now)
            elif e.restart_at is not None and now >= e.restart_at:
                self._restart(e, now)
            elif not e.announced and e.ready_probe(e.child):
                e.announced = True
                log.warning("%s is back (restart %d)", e.name, e.restarts)
                self.on_ready(e.name, e.restarts, e.child.ready or {})

    def _died(self, e: Supervised, now: float) -> None:
        e.last_exit = e.child.proc.returncode if e.child.proc is not None else None
        if e.name in self.gave_up or e.name in self.stopped:
            return
        if e.last_exit == 0:
            self.stopped.append(e.name)
            log.warning("%s exited (code 0): stopped on purpose, not restarted; the rest keep serving", e.name)
            return
        if now - e.started_at >= self.stable_s:
            e.backoff_s = self.backoff_s             # it had been running fine: a fresh failure
        if e.restarts >= self.max_restarts:
            self.gave_up.append(e.name)
            log.error("%s exited (%s); restarted %d times already (--max-restarts): leaving it down",
                      e.name, describe_exit(e.last_exit), e.restarts)
            return
        e.restart_at = now + e.backoff_s
        log.error("%s exited (%s); restarting it in %.1fs (restart %d)",
                  e.name, describe_exit(e.last_exit), e.backoff_s, e.restarts + 1)
        e.backoff_s = min(self.max_backoff_s, e.backoff_s * 2)

    def _restart(self, e: Supervised, now: float) -> None:
        e.restart_at = None
        e.restarts += 1
        e.started_at = now
        e.announced = False
        try:
            e.child = e.start()
        except Exception as exc:   # e.g. Redis did not come back in time: count it, try again later
            log.error("restarting %s failed: %s", e.name, exc)
            e.restart_at = now + e.backoff_s
            e.backoff_s = min(self.max_backoff_s, e.backoff_s * 2)
