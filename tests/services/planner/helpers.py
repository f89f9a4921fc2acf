"""Constructed observations and a fake actuator for the planner's tests (torch-free)."""

from __future__ import annotations

from tandem.services.planner.observe import Observation, StepCost
from tandem.services.planner.shape import Shape

# Step costs of the order measured on a 2-core CPU: 30 ms a step, 2 ms a decode row, 1.5 ms a prompt token.
PREFILL_FIT = StepCost(0.03, 0.0, 0.0015)
DECODE_FIT = StepCost(0.03, 0.002, 0.0)


def obs(rate: float, prompt: float = 256, output: float = 64, shape: Shape = Shape(1, 1), t: float = 0.0,
        **kw) -> Observation:
    workers = {"decode": shape.decode, **({"prefill": shape.prefill} if shape.prefill else {})}
    fits = {"decode": DECODE_FIT, **({"prefill": PREFILL_FIT} if shape.prefill else {})}
    if not shape.prefill:   # co-located: the decode workers' fit has both terms
        fits = {"decode": StepCost(0.03, 0.002, 0.0015)}
    return Observation(t=t, interval_s=10.0, arrival_rate=rate, finished=max(1, int(rate * 10)),
                       prompt_tokens=prompt, output_tokens=output, workers=workers,
                       step_costs=kw.pop("step_costs", fits), **kw)


class FakeActuator:
    name = "fake"

    def __init__(self, shape: Shape | None, apply_at_once: bool = True):
        self.shape = shape
        self.is_busy = False
        self.apply_at_once = apply_at_once
        self.applied: list[Shape] = []

    def current(self) -> Shape | None:
        return self.shape

    def busy(self) -> bool:
        return self.is_busy

    def apply(self, shape: Shape, reason: str) -> None:
        assert reason
        self.applied.append(shape)
        if self.apply_at_once:
            self.shape = shape
