"""Fault injection for tests and chaos drills: the one place a worker reads TANDEM_FAULT_* variables.

    TANDEM_FAULT_STEP_HANG_AT=N    the N-th engine step (1-based; it contains the forward pass) hangs
    TANDEM_FAULT_STEP_HANG_S=S     for S seconds (default 3600)

Unset, nothing is injected and the hook costs one comparison per step. Read once, when the worker
starts (never at import time).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass

log = logging.getLogger(__name__)

HANG_AT_ENV = "TANDEM_FAULT_STEP_HANG_AT"
HANG_S_ENV = "TANDEM_FAULT_STEP_HANG_S"


@dataclass(frozen=True)
class FaultConfig:
    step_hang_at: int = 0          # 0: never
    step_hang_s: float = 3600.0

    @property
    def any(self) -> bool:
        return self.step_hang_at > 0

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> FaultConfig:
        env = os.environ if environ is None else environ
        try:
            return cls(step_hang_at=int(env.get(HANG_AT_ENV, "0") or 0),
                       step_hang_s=float(env.get(HANG_S_ENV, "3600") or 3600))
        except ValueError as e:
            raise SystemExit(f"bad fault-injection setting ({HANG_AT_ENV}/{HANG_S_ENV}): {e}") from None


class FaultInjector:
    """A StepObserver (services/worker/loop.py) that makes the configured step hang."""

    def __init__(self, cfg: FaultConfig):
        self.cfg = cfg
        self._steps = 0

    def before_step(self) -> None:
        self._steps += 1
        if self._steps == self.cfg.step_hang_at:
            log.warning("fault injection: step %d hangs for %gs (%s)", self._steps, self.cfg.step_hang_s, HANG_AT_ENV)
            time.sleep(self.cfg.step_hang_s)

    def after_step(self, elapsed_s: float) -> None:
        pass
