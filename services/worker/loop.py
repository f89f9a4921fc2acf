"""The engine thread: one thread owns the model and the scheduler; asyncio code talks to it by message.

gRPC handlers run on the asyncio loop and must never block on a forward pass, and the model must
never wait for Python's event loop. So every worker runs its `StepWorker` in one dedicated thread:
handlers `call(fn)` to run a function there (getting an asyncio future back), and the worker hands
results back with `deliver(fn)`, which schedules `fn` on the asyncio loop.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

log = logging.getLogger(__name__)


class StepWorker(Protocol):
    def has_work(self) -> bool: ...

    def step(self) -> None:
        """Run one scheduler step (a forward pass)."""

    def tick(self) -> None:
        """Cheap periodic housekeeping: timeouts, transfer polling, metrics."""

    def on_idle(self) -> None:
        """Called when the worker just became idle: the place for the idle self-check."""

    def polling(self) -> bool:
        """True while `tick` has something to watch (transfers, timeouts): tick often then."""


class StepObserver(Protocol):
    """Sees every step from the engine thread (step metrics, the profiler); must be cheap."""

    def before_step(self) -> None: ...

    def after_step(self, elapsed_s: float) -> None:
        """`elapsed_s`: the step's wall time (perf_counter around it; no device sync)."""


class EngineLoop:
    """Lifecycle: create -> start() -> (serve) -> stop(); stop is safe to call twice."""

    def __init__(self, worker: StepWorker, aio_loop: asyncio.AbstractEventLoop,
                 on_fatal: Callable[[], None] = lambda: None, idle_wait_s: float = 0.002,
                 quiet_wait_s: float = 0.05, observers: Sequence[StepObserver] = (),
                 tickers: Sequence[Callable[[], None]] = ()):
        """`tickers`: housekeeping of other components run on this thread after each `worker.tick()`
        (e.g. flushing the KV events the step produced); must be cheap."""
        self.worker = worker
        self.observers = tuple(observers)
        self.tickers = tuple(tickers)
        self.on_fatal = on_fatal
        self.failed = False
        self.aio_loop = aio_loop
        self._calls: queue.SimpleQueue[tuple[Callable[[], Any], asyncio.Future | None]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._idle_wait_s = idle_wait_s    # between ticks while transfers/timeouts are pending
        self._quiet_wait_s = quiet_wait_s  # when nothing is: commands still wake the loop at once
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self.steps = 0
        self.busy_s = 0.0

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    # --- asyncio side ------------------------------------------------------------------------
    def call(self, fn: Callable[[], Any]) -> asyncio.Future:
        """Run `fn()` on the engine thread before its next step; await the returned future."""
        fut = self.aio_loop.create_future()
        self._calls.put((fn, fut))
        self._wake.set()
        return fut

    def post(self, fn: Callable[[], Any]) -> None:
        """Like `call`, fire and forget (errors are logged)."""
        self._calls.put((fn, None))
        self._wake.set()

    # --- engine side -------------------------------------------------------------------------
    def deliver(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run `fn(*args)` on the asyncio loop (engine thread -> handlers)."""
        try:
            self.aio_loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:
            pass  # loop closed during shutdown: nobody is listening any more

    def _run_calls(self) -> None:
        while True:
            try:
                fn, fut = self._calls.get_nowait()
            except queue.Empty:
                return
            try:
                result = fn()
            except Exception as e:  # a handler's error belongs to that handler, not to the loop
                if fut is None:
                    log.exception("engine call failed")
                else:
                    self.deliver(_set_exception, fut, e)
            else:
                if fut is not None:
                    self.deliver(_set_result, fut, result)

    def _run(self) -> None:
        was_busy = False
        while not self._stop.is_set():
            self._run_calls()
            try:
                self.worker.tick()
            except Exception:
                log.exception("worker housekeeping failed")
            for tick in self.tickers:
                _observe(tick)
            if self.worker.has_work():
                for o in self.observers:
                    _observe(o.before_step)
                t0 = time.perf_counter()
                try:
                    self.worker.step()
                except Exception:
                    # A failed forward pass leaves the batch's state unknown: stop serving and let
                    # the supervisor restart the process (peers fail only the requests it held).
                    log.exception("engine step failed; stopping the worker")
                    self.failed = True
                    self.deliver(self.on_fatal)
                    return
                elapsed = time.perf_counter() - t0
                self.busy_s += elapsed
                self.steps += 1
                for o in self.observers:
                    _observe(o.after_step, elapsed)
                was_busy = True
                continue
            if was_busy:
                was_busy = False
                self.worker.on_idle()
            self._wake.wait(self._idle_wait_s if self.worker.polling() else self._quiet_wait_s)
            self._wake.clear()


def _observe(fn: Callable[..., None], *args: Any) -> None:
    try:
        fn(*args)
    except Exception:  # an observer's bug must not stop serving
        log.exception("step observer failed")


def _set_result(fut: asyncio.Future, value: Any) -> None:
    if not fut.done():
        fut.set_result(value)


def _set_exception(fut: asyncio.Future, exc: BaseException) -> None:
    if not fut.done():
        fut.set_exception(exc)

