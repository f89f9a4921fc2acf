"""How long steps take, learned from the steps themselves: the mixed-chunk budget's cost model.

A mixed step runs one prefill chunk beside one token of every running request, so each chunk token
delays every running request's next token. `StepCostModel` fits `seconds ≈ a + b·decode_rows +
c·prefill_tokens` to recent steps (exponentially weighted least squares over three numbers, so it
follows a batch that grows or shrinks, and learns from mixed steps as well as pure ones) and turns a
bound on that delay ("a mixed step takes at most `factor` × a decode step of the same rows") into a
token budget for the chunk: `(factor - 1)(a + b·rows) / c`. Time is measured by the scheduler
between handing out a batch and hearing it finished (torch-free, no device sync).
"""

from __future__ import annotations

from dataclasses import dataclass, field

_DECAY = 0.97     # weight of older steps per new one: the fit follows the last ~30 steps
_RIDGE = 1e-6     # keeps the normal equations solvable before every kind of step was seen
_MIN_STEPS = 4


@dataclass
class StepCostModel:
    decay: float = _DECAY   # 1.0: every step weighs the same (a fit to a whole trace, bench/sched_sim.py)
    ridge: float = _RIDGE
    _xtx: list[list[float]] = field(default_factory=lambda: [[0.0] * 3 for _ in range(3)])
    _xty: list[float] = field(default_factory=lambda: [0.0] * 3)
    steps: int = 0
    _seen_mixed_or_prefill: bool = False
    _seen_decode: bool = False

    def observe(self, prefill_tokens: int, decode_rows: int, seconds: float) -> None:
        if seconds <= 0:
            return
        x = (1.0, float(decode_rows), float(prefill_tokens))
        for i in range(3):
            self._xty[i] = self.decay * self._xty[i] + x[i] * seconds
            for j in range(3):
                self._xtx[i][j] = self.decay * self._xtx[i][j] + x[i] * x[j]
        self.steps += 1
        self._seen_mixed_or_prefill |= prefill_tokens > 0
        self._seen_decode |= decode_rows > 0

    def coefficients(self) -> tuple[float, float, float] | None:
        """(a, b, c) of the current fit, or None until steps of both kinds were seen."""
        if self.steps < _MIN_STEPS or not (self._seen_decode and self._seen_mixed_or_prefill):
            return None
        a = [[self._xtx[i][j] + (self.ridge if i == j else 0.0) for j in range(3)] for i in range(3)]
        return _solve3(a, list(self._xty))

    def fit(self) -> tuple[float, float, float] | None:
        """(a, b, c) fitted to every step seen so far, for reporting (the planner reads it through
        the worker's load): None only before `_MIN_STEPS` steps. Unlike `coefficients`, which the
        budgets trust only once both kinds of step were seen, a term that no step exercised comes
        out 0 (the ridge pins it): a prefill-only worker reports its base and per-token cost with
        b = 0, a decode worker that never prefilled reports c = 0. When every step had the same size
        the base and the per-unit cost cannot be told apart and the ridge splits them (mostly into
        the per-unit term); their sum at that size is still what was measured."""
        if self.steps < _MIN_STEPS:
            return None
        a = [[self._xtx[i][j] + (self.ridge if i == j else 0.0) for j in range(3)] for i in range(3)]
        return _solve3(a, list(self._xty))

    def decode_step_s(self, rows: int) -> float | None:
        coef = self.coefficients()
        return None if coef is None else coef[0] + coef[1] * rows

    def prefill_budget(self, factor: float, decode_rows: int, floor: int, cap: int) -> int:
        """Most chunk tokens that keep a mixed step with `decode_rows` within `factor` × a decode
        step (`cap` while nothing is known yet or `factor` is 0; never below `floor`, so prompts
        still progress)."""
        coef = self.coefficients() if factor else None
        if coef is None:
            return cap
        a, b, c = coef
        decode = a + b * decode_rows
        if c <= 0 or decode <= 0:
            return cap
        return max(floor, min(cap, int(round((factor - 1.0) * decode / c, 3))))


def _solve3(a: list[list[float]], y: list[float]) -> tuple[float, float, float] | None:
    """Gaussian elimination with partial pivoting on a 3×3 system; None if singular."""
    m = [row[:] + [y[i]] for i, row in enumerate(a)]
    for col in range(3):
        pivot = max(range(col, 3), key=lambda r: abs(m[r][col]))
        if abs(m[pivot][col]) < 1e-18:
            return None
        m[col], m[pivot] = m[pivot], m[col]
        for r in range(3):
            if r != col:
                f = m[r][col] / m[col][col]
                m[r] = [m[r][k] - f * m[col][k] for k in range(4)]
    return m[0][3] / m[0][0], m[1][3] / m[1][1], m[2][3] / m[2][2]
