"""A torch.profiler trace of a live worker's next N engine steps, asked for over HTTP.

Any thread may `request(steps)`; the engine thread (as an `EngineLoop` observer) starts the profiler
right before the next step, marks each step with a `record_function` range, and stops it and writes
a Chrome trace JSON right after the N-th (open it in chrome://tracing or https://ui.perfetto.dev).
Between requests the hot path pays one attribute check per step.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger(__name__)

MAX_STEPS = 10_000


class ProfileBusy(RuntimeError):
    """A trace is already being recorded (one at a time)."""


@dataclass(eq=False)
class ProfileJob:
    steps: int
    path: Path
    done: threading.Event = field(default_factory=threading.Event)
    error: str | None = None
    steps_done: int = 0


class StepProfiler:
    """Lifecycle: request() from any thread -> the engine thread records the job's steps -> the job's
    `done` is set once the file is written (or `error` says why not)."""

    def __init__(self, out_dir: str | Path, name: str):
        self.out_dir = Path(out_dir).expanduser()
        self.name = re.sub(r"[^A-Za-z0-9_.-]", "_", name)
        self._lock = threading.Lock()
        self._job: ProfileJob | None = None     # requested or recording; cleared when done
        self._prof = None                       # the running torch.profiler.profile
        self._range = None                      # the current step's record_function

    def request(self, steps: int) -> ProfileJob:
        """Record the next `steps` engine steps. Raises ValueError, ProfileBusy."""
        if not 1 <= steps <= MAX_STEPS:
            raise ValueError(f"steps must be in [1, {MAX_STEPS}], got {steps}")
        with self._lock:
            if self._job is not None:
                raise ProfileBusy(f"already recording a trace of {self._job.steps} steps to {self._job.path}")
            stamp = time.strftime("%Y%m%d-%H%M%S")
            path = self.out_dir / f"{self.name}-{stamp}-{time.time_ns() % 10**9:09d}-{steps}steps.trace.json"
            self._job = ProfileJob(steps, path)
            return self._job

    # --- engine thread -------------------------------------------------------------------------
    def before_step(self) -> None:
        job = self._job
        if job is None:
            return
        import torch

        if self._prof is None:
            try:
                self.out_dir.mkdir(parents=True, exist_ok=True)
                activities = [torch.profiler.ProfilerActivity.CPU]
                if torch.cuda.is_available():
                    activities.append(torch.profiler.ProfilerActivity.CUDA)
                self._prof = torch.profiler.profile(activities=activities, record_shapes=True)
                self._prof.__enter__()
            except Exception as e:  # a profiler that cannot start must not stop the worker
                self._prof = None
                self._finish(job, f"could not start the profiler: {e}")
                return
            log.info("profiling the next %d steps to %s", job.steps, job.path)
        self._range = torch.profiler.record_function(f"tandem_step#{job.steps_done}")
        self._range.__enter__()

    def after_step(self, elapsed_s: float) -> None:
        job = self._job
        if job is None or self._prof is None:
            return
        if self._range is not None:
            self._range.__exit__(None, None, None)
            self._range = None
        job.steps_done += 1
        if job.steps_done < job.steps:
            return
        prof, self._prof = self._prof, None
        try:
            prof.__exit__(None, None, None)
            prof.export_chrome_trace(str(job.path))
        except Exception as e:
            self._finish(job, f"could not write the trace: {e}")
            return
        log.info("wrote a trace of %d steps to %s", job.steps, job.path)
        self._finish(job, None)

    def _finish(self, job: ProfileJob, error: str | None) -> None:
        if error:
            log.error("%s", error)
        job.error = error
        with self._lock:
            self._job = None
        job.done.set()
