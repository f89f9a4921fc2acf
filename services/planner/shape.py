"""What the planner decides and what acts on it: a `Shape`, a `Decision`, and the `Actuator` interface.

A shape counts the workers of a disaggregated deployment by role. A shape with no prefill worker is
a co-located deployment: every decode worker prefills its own prompts (mixed chunks, the router's
local route), so `Shape(0, 2)` serves like `tandem up --colocated 2` while staying one hop away from
`Shape(1, 1)` (one worker changes role). Every shape has a decode worker: a request needs one.

Actuators: `services/planner/host.py` (one machine: `tandem up`'s launcher moves workers between
roles on fixed core slots) and `services/planner/k8s.py` (the prefill and decode Deployments' scale).
Torch-free.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Protocol

_SHAPE = re.compile(r"^\s*(\d+)\s*P\s*(\d+)\s*D\s*$", re.IGNORECASE)


@dataclass(frozen=True, order=True)
class Shape:
    prefill: int
    decode: int

    def __post_init__(self):
        if self.prefill < 0 or self.decode < 1:
            raise ValueError(f"a shape needs prefill >= 0 and decode >= 1, got {self.prefill}P{self.decode}D")

    @property
    def workers(self) -> int:
        return self.prefill + self.decode

    @property
    def colocated(self) -> bool:
        """No prefill worker: the decode workers prefill their own prompts."""
        return self.prefill == 0

    def __str__(self) -> str:
        return f"{self.prefill}P{self.decode}D"

    @classmethod
    def parse(cls, text: str) -> Shape:
        """'1P1D' / '0p2d'. Raises ValueError with the accepted form."""
        m = _SHAPE.match(text)
        if m is None:
            raise ValueError(f"a shape is written like 1P1D (prefill, decode workers), got {text!r}")
        return cls(int(m.group(1)), int(m.group(2)))

    def to_json(self) -> dict:
        return {"prefill": self.prefill, "decode": self.decode}

    @classmethod
    def from_json(cls, d: dict) -> Shape:
        return cls(int(d["prefill"]), int(d["decode"]))


@dataclass(frozen=True)
class Decision:
    """One planning interval's outcome, logged (a JSON line) and exported as metrics."""

    t: float                               # wall-clock seconds (time.time())
    current: Shape | None                  # what runs now (None: not known yet)
    desired: Shape                         # what the planner wants (== current: keep)
    action: str                            # "keep" | "reshape" | "hold" (better found, hysteresis waits)
    reason: str                            # one sentence a person can read
    inputs: dict = field(default_factory=dict)      # the observed and predicted load it decided on
    scores: dict = field(default_factory=dict)      # per candidate shape: predicted TTFT/ITL, feasible

    def to_json(self) -> dict:
        return {"t": self.t, "current": str(self.current) if self.current else None, "desired": str(self.desired),
                "action": self.action, "reason": self.reason, "inputs": self.inputs, "scores": self.scores}


class Actuator(Protocol):
    """Applies a shape. Implementations never block the planner's loop for long."""

    name: str

    def current(self) -> Shape | None:
        """The shape running now (None: unknown, e.g. the launcher has not reported yet)."""

    def busy(self) -> bool:
        """A reshape is still being applied: the planner decides nothing new until it is done."""

    def apply(self, shape: Shape, reason: str) -> None:
        """Start moving to `shape` (returns at once; `busy()` is true until it is done)."""
