"""Fault injection for tests and chaos drills: the one place a worker reads its fault settings.

`--fault-inject KEY=VALUE,...` (refused unless `--enable-fault-injection` is given too or the
environment has TANDEM_ALLOW_FAULTS=1, so that a copied command line cannot break a deployment):

    transfer_fail=P        each room's KV transfer fails with probability P (0..1): the prefill
                           worker aborts it after its first write, so both sides take the abort path
    transfer_delay_ms=MS   each room's completion (its aux record) is sent MS later
    kv_corrupt=P           each room's KV is corrupted on its way with probability P (0..1): one byte of
                           its first write is flipped after the prefill worker took its checksum, so the
                           decode worker's integrity check must catch it (docs/resilience.md)
    forward_delay_ms=MS    every engine step (it contains the forward pass) starts MS later
    seed=N                 seed of the draws (default: random)

Transfer faults act where KV is sent (prefill workers); the other keys on every worker. The
environment adds the hang the watchdog test uses:

    TANDEM_FAULT_STEP_HANG_AT=N    the N-th engine step (1-based) hangs
    TANDEM_FAULT_STEP_HANG_S=S     for S seconds (default 3600)

Unset, nothing is injected and nothing wraps the hot path. Read once, when the worker starts (never
at import time).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace

log = logging.getLogger(__name__)

HANG_AT_ENV = "TANDEM_FAULT_STEP_HANG_AT"
HANG_S_ENV = "TANDEM_FAULT_STEP_HANG_S"
ALLOW_ENV = "TANDEM_ALLOW_FAULTS"
_SPEC_KEYS = ("transfer_fail", "transfer_delay_ms", "kv_corrupt", "forward_delay_ms", "seed")
_PROBABILITIES = ("transfer_fail", "kv_corrupt")


class FaultSpecError(ValueError):
    """A bad or unauthorized `--fault-inject` value."""


@dataclass(frozen=True)
class FaultConfig:
    step_hang_at: int = 0          # 0: never
    step_hang_s: float = 3600.0
    transfer_fail: float = 0.0     # probability per room
    transfer_delay_ms: float = 0.0
    kv_corrupt: float = 0.0        # probability per room
    forward_delay_ms: float = 0.0
    seed: int | None = None

    @property
    def any(self) -> bool:
        return self.step_hang_at > 0 or self.forward_delay_ms > 0 or self.transfers or self.kv_corrupt > 0

    @property
    def transfers(self) -> bool:
        return self.transfer_fail > 0 or self.transfer_delay_ms > 0

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> FaultConfig:
        env = os.environ if environ is None else environ
        try:
            return cls(step_hang_at=int(env.get(HANG_AT_ENV, "0") or 0),
                       step_hang_s=float(env.get(HANG_S_ENV, "3600") or 3600))
        except ValueError as e:
            raise SystemExit(f"bad fault-injection setting ({HANG_AT_ENV}/{HANG_S_ENV}): {e}") from None

    @classmethod
    def load(cls, spec: str, enabled: bool, environ: Mapping[str, str] | None = None) -> FaultConfig:
        """The environment's hang plus `spec` (the `--fault-inject` value). Raises FaultSpecError."""
        env = os.environ if environ is None else environ
        base = cls.from_env(env)
        if not spec:
            return base
        if not (enabled or env.get(ALLOW_ENV, "") == "1"):
            raise FaultSpecError(f"--fault-inject makes requests fail on purpose: it is refused unless "
                                 f"--enable-fault-injection is given or {ALLOW_ENV}=1")
        return replace(base, **parse_spec(spec))


def parse_spec(spec: str) -> dict:
    """`transfer_fail=0.1,forward_delay_ms=20` -> FaultConfig fields. Raises FaultSpecError."""
    types = {f.name: f.type for f in fields(FaultConfig)}
    out: dict = {}
    for item in filter(None, (s.strip() for s in spec.split(","))):
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or key not in _SPEC_KEYS:
            raise FaultSpecError(f"--fault-inject: {item!r} is not KEY=VALUE with KEY one of {', '.join(_SPEC_KEYS)}")
        try:
            out[key] = int(value) if key == "seed" else float(value)
        except ValueError:
            raise FaultSpecError(f"--fault-inject: {key}={value!r} is not a number") from None
        if key in _PROBABILITIES and not 0.0 <= out[key] <= 1.0:
            raise FaultSpecError(f"--fault-inject: {key}={value} is not a probability in [0, 1]")
        if key.endswith("_ms") and out[key] < 0:
            raise FaultSpecError(f"--fault-inject: {key}={value} is negative")
    assert set(out) <= set(types)
    return out


class FaultInjector:
    """A StepObserver (services/worker/loop.py): delays every step, or makes the configured one hang."""

    def __init__(self, cfg: FaultConfig):
        self.cfg = cfg
        self._steps = 0
        self._delay_s = cfg.forward_delay_ms / 1e3

    def before_step(self) -> None:
        self._steps += 1
        if self._steps == self.cfg.step_hang_at:
            log.warning("fault injection: step %d hangs for %gs (%s)", self._steps, self.cfg.step_hang_s, HANG_AT_ENV)
            time.sleep(self.cfg.step_hang_s)
        if self._delay_s:
            time.sleep(self._delay_s)

    def after_step(self, elapsed_s: float) -> None:
        pass
