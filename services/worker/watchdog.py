"""The step watchdog: a step (scheduling + forward pass) that hangs kills the worker, loudly.

A hung forward pass (a wedged GPU, a deadlocked collective, a kernel that never returns) leaves a
worker that still answers health checks but serves nothing. With `--watchdog-timeout S`, a step that
has not finished after S seconds makes the watchdog log every thread's stack and exit the process
with EXIT_CODE, so that the supervisor (`tandem up`, Kubernetes) restarts it; peers fail only the
requests it held.

Two layers, because a hang may or may not hold the GIL:
- a Python thread checks the step's start time every `timeout / 4` seconds; on a hang it logs the
  stacks (sys._current_frames) through `logging` and calls `os._exit(EXIT_CODE)`;
- each time that thread runs it re-arms `faulthandler.dump_traceback_later` a little beyond the
  timeout: if the Python thread itself cannot run (the GIL is held forever), faulthandler's C
  thread dumps the stacks to stderr and exits 1.

Lifecycle: create -> start() -> (before_step/after_step from the engine loop) -> stop(); stop is
safe to call twice. A StepObserver (services/worker/loop.py).
"""

from __future__ import annotations

import faulthandler
import logging
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable

log = logging.getLogger(__name__)

EXIT_CODE = 3  # distinct from 1 (a failed step) so that logs and tests can tell a hang apart


def format_all_stacks() -> str:
    names = {t.ident: t.name for t in threading.enumerate()}
    parts = []
    for ident, frame in sys._current_frames().items():
        parts.append(f'Thread {names.get(ident, "?")} ({ident}):\n' + "".join(traceback.format_stack(frame)))
    return "\n".join(parts)


def _die(message: str) -> None:
    log.critical("%s; stacks of every thread:\n%s", message, format_all_stacks())
    logging.shutdown()
    sys.stderr.flush()
    os._exit(EXIT_CODE)


class Watchdog:
    def __init__(self, timeout_s: float, on_hang: Callable[[str], None] = _die):
        assert timeout_s > 0
        self.timeout_s = timeout_s
        self.on_hang = on_hang
        self._started: float | None = None   # monotonic start of the running step; None between steps
        self._steps = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="watchdog", daemon=True)
        self._period = min(1.0, timeout_s / 4)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(5.0)
        faulthandler.cancel_dump_traceback_later()

    # --- StepObserver (engine thread): two attribute writes per step --------------------------
    def before_step(self) -> None:
        self._steps += 1
        self._started = time.monotonic()

    def after_step(self, elapsed_s: float) -> None:
        self._started = None

    # --- watchdog thread -----------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.wait(self._period):
            # The backstop fires only if this thread stops running for longer than a step may take.
            faulthandler.dump_traceback_later(self.timeout_s + 2 * self._period + 1.0, exit=True)
            started, step = self._started, self._steps
            if started is not None and time.monotonic() - started > self.timeout_s:
                faulthandler.cancel_dump_traceback_later()
                self.on_hang(f"watchdog: engine step {step} has not finished after {self.timeout_s:g}s "
                             f"(--watchdog-timeout); exiting so that the supervisor restarts this worker")
                return
        faulthandler.cancel_dump_traceback_later()
