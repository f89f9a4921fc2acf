"""When speculation pays: a per-batch switch driven by measured step times and acceptance (torch-free).

A verify step costs more than a plain decode step (k more tokens per row through every layer, and
the extend attention path instead of the decode one) and pays only through accepted drafts. The gate
fits `seconds ≈ a + b·rows + c·drafts` to recent decode steps of both kinds (StepCostModel, with
drafts in the place of prefill tokens) and tracks the acceptance rate of recent drafts. With the
drafts proposed for this step it compares

    tokens/s speculating = (rows + rate·drafts) / (a + b·rows + c·drafts)
    tokens/s plain       =  rows / (a + b·rows)

and speculates when the first is larger. Measurements go stale once one side stops running, so
every `probe_every` steps the other side runs once anyway; until both kinds of step were measured
the two alternate.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tandem.engine.scheduler.step_cost import StepCostModel

_RATE_DECAY = 0.9      # acceptance rate follows the last ~10 verify steps
PROBE_EVERY = 16


@dataclass
class SpecGate:
    adaptive: bool = True
    probe_every: int = PROBE_EVERY
    cost: StepCostModel = field(default_factory=StepCostModel)
    _drafted: float = 0.0
    _accepted: float = 0.0
    _streak: int = 0          # consecutive decisions the same way
    _last: bool | None = None
    enabled: bool = True      # the latest decision (exported as a metric)

    @property
    def acceptance_rate(self) -> float | None:
        return self._accepted / self._drafted if self._drafted > 0 else None

    def decide(self, rows: int, drafts: int) -> bool:
        """Whether this step should verify its `drafts` drafts (over `rows` decode rows)."""
        if drafts == 0:
            return False
        if not self.adaptive:
            return True
        want = self._worth_it(rows, drafts)
        if want is None:                       # not measured yet: alternate
            want = not self._last if self._last is not None else True
        elif want == self._last and self._streak + 1 >= self.probe_every:
            want = not want                    # probe the other side to keep its numbers fresh
        self._streak = self._streak + 1 if want == self._last else 1
        self._last = self.enabled = want
        return want

    def _worth_it(self, rows: int, drafts: int) -> bool | None:
        coef = self.cost.coefficients()
        rate = self.acceptance_rate
        if coef is None or rate is None:
            return None
        a, b, c = coef
        plain = a + b * rows
        if plain <= 0:
            return None
        spec = plain + max(c, 0.0) * drafts
        return (rows + rate * drafts) / spec > rows / plain

    def observe(self, rows: int, drafts: int, accepted: int, seconds: float) -> None:
        """A finished decode step: `drafts` drafts verified over `rows` rows (0 for a plain step),
        `accepted` of them accepted, in `seconds`."""
        self.cost.observe(drafts, rows, seconds)
        if drafts:
            self._drafted = _RATE_DECAY * self._drafted + drafts
            self._accepted = _RATE_DECAY * self._accepted + accepted
