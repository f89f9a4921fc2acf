"""Predicted TTFT and ITL of any shape under a load, from the workers' fitted step costs only.

A worker's step takes `a + b·rows + c·tokens` seconds (engine/scheduler/step_cost.py, reported in
WorkerLoad.step_cost). With λ requests/s of `Li` prompt and `Lo` output tokens, and a backlog of `B`
prompt tokens to clear within the coming interval `H`:

- **Prefill workers (P > 0).** A prompt takes `S = a_p + c_p·Li` on one of P workers, busy
  `ρ = (λ·S + c_p·B/H) / P`; the wait is M/D/1's, mean `ρS / 2(1-ρ)`, and its quantile q comes from
  the heavy-traffic tail (wait > 0 with probability ρ, then exponential):
  `W_q = (E[W]/ρ)·ln(ρ/(1-q))` when ρ > 1-q, else 0. TTFT_q = S + W_q + one decode step (D streams
  the first token in its next step). Infeasible at ρ ≥ 1.
- **Decode workers.** Rows per worker by Little's law, `R = λ·Lo·ITL / D`, and `ITL = a_d + b_d·R`,
  so `ITL = a_d / (1 - b_d·λ·Lo/D)`; infeasible when `b_d·λ·Lo/D ≥ 1`.
- **Co-located (P = 0).** Each decode worker also prefills its prompts inside its steps:
  `u_c = c_d·(λ·Li + B/H)/D` of its time goes to prompt tokens, so `ITL = a_d / (1 - b_d·λ·Lo/D - u_c)`.
  Its prompts queue (M/D/1) for the time the rows leave: service `(a_d + c_d·Li)/(1 - b_d·λ·Lo/D)`,
  `ρ = λ·that/D` (plus the backlog). A prompt's own prefill takes longer than that service while the
  worker has rows (probability `1 - e^-R`): the mixed-chunk bound (`factor`: a step with a chunk
  takes at most factor × a decode step) spreads it over `c_d·Li·factor/(factor-1)` seconds, cut to
  the scheduler's TTFT target.

Predictions are multiplied by a correction, measured/predicted for the running shape (decide.py),
which absorbs what the formulas leave out (transfer time, the router, percentile shape). Torch-free.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from tandem.services.planner.observe import StepCost
from tandem.services.planner.predict import Load
from tandem.services.planner.shape import Shape

INF = math.inf


class NotFitted(Exception):
    """The workers have not reported the step costs a prediction needs (yet)."""


@dataclass(frozen=True)
class Costs:
    prefill_base_s: float    # a dedicated prefill worker's step: a_p + c_p·tokens
    prefill_token_s: float
    decode_base_s: float     # a decode worker's step: a_d + b_d·rows (+ c_d·tokens of its own prefill)
    decode_row_s: float
    local_token_s: float

    @classmethod
    def from_roles(cls, fits: dict[str, StepCost]) -> Costs:
        """From each role's mean fit. A term a role never exercised is 0 in its fit (a prefill worker's
        per-row cost, a decode worker's per-token cost while it prefilled nothing): it is then taken
        from the other role, whose workers run the same model on the same kind of slot."""
        decoding = [f for r in ("decode", "colocated") if (f := fits.get(r)) is not None and f.per_row_s > 0]
        if not decoding:
            raise NotFitted("no decode worker has reported a fit of its decode steps yet")
        d = decoding[0]
        local = [f for r in ("colocated", "decode") if (f := fits.get(r)) is not None and f.per_token_s > 0]
        dedicated = fits.get("prefill")
        dedicated = dedicated if dedicated is not None and dedicated.per_token_s > 0 else None
        if dedicated is None and not local:
            raise NotFitted("no worker has reported a fit of its prefill steps yet")
        p = dedicated or local[0]
        return cls(prefill_base_s=max(0.0, p.base_s), prefill_token_s=p.per_token_s,
                   decode_base_s=max(0.0, d.base_s), decode_row_s=d.per_row_s,
                   local_token_s=(local[0] if local else p).per_token_s)

    def to_json(self) -> dict:
        return {k: round(v, 7) for k, v in self.__dict__.items()}


@dataclass(frozen=True)
class Prediction:
    ttft_s: float            # at the model's quantile (inf: the prefill side cannot keep up)
    itl_s: float             # mean (inf: the decode side cannot keep up)
    prefill_util: float      # ρ of whoever prefills
    decode_util: float       # fraction of a decode worker's time its rows (and own prompts) take
    measured: bool = False   # TTFT and ITL are what this shape measured at a close load (decide.py)

    @property
    def bounded(self) -> bool:
        return math.isfinite(self.ttft_s) and math.isfinite(self.itl_s)

    def scaled(self, ttft: float, itl: float) -> Prediction:
        return Prediction(self.ttft_s * ttft, self.itl_s * itl, self.prefill_util, self.decode_util, self.measured)

    def to_json(self) -> dict:
        def r(x: float) -> float | None:
            return round(x, 4) if math.isfinite(x) else None
        return {"ttft": r(self.ttft_s), "itl": r(self.itl_s), "prefill_util": round(self.prefill_util, 3),
                "decode_util": round(self.decode_util, 3), "measured": self.measured}


def wait_quantile(mean_wait: float, rho: float, q: float) -> float:
    """Quantile q of a queue's wait with mean `mean_wait` at utilisation `rho` (0 < rho < 1)."""
    if rho <= 1 - q or mean_wait <= 0:
        return 0.0
    return (mean_wait / rho) * math.log(rho / (1 - q))


def md1_wait(rho: float, service_s: float) -> float:
    return rho * service_s / (2 * (1 - rho))


@dataclass(frozen=True)
class CapacityModel:
    costs: Costs
    quantile: float = 0.9               # the TTFT quantile predicted
    horizon_s: float = 10.0             # the backlog is cleared within this long (the planning interval)
    itl_factor: float = 1.5             # the decode workers' mixed_chunk_itl_factor (0: unbounded)
    ttft_target_s: float = 1.5          # their mixed_chunk_ttft_target_s (0: off)
    ttft_correction: float = 1.0
    itl_correction: float = 1.0

    def predict(self, shape: Shape, load: Load) -> Prediction:
        raw = self.predict_raw(shape, load)
        return raw.scaled(self.ttft_correction, self.itl_correction)

    def predict_raw(self, shape: Shape, load: Load) -> Prediction:
        """The formulas alone, before the correction."""
        c = self.costs
        lam, li, lo = load.rate, load.prompt_tokens, load.output_tokens
        backlog_rate = load.backlog_tokens / self.horizon_s
        d = shape.decode
        u_rows = c.decode_row_s * lam * lo / d
        if shape.prefill > 0:
            itl = c.decode_base_s / (1 - u_rows) if u_rows < 1 else INF
            service = c.prefill_base_s + c.prefill_token_s * li
            rho = (lam * service + c.prefill_token_s * backlog_rate) / shape.prefill
            ttft = service + self._wait(rho, service) + itl if rho < 1 else INF
            return Prediction(ttft, itl, rho, u_rows)
        # Co-located: every decode worker prefills its own prompts between its rows.
        u_prompts = c.local_token_s * (lam * li + backlog_rate) / d
        busy = u_rows + u_prompts
        itl = c.decode_base_s / (1 - busy) if busy < 1 else INF
        alone = c.decode_base_s + c.local_token_s * li
        if not math.isfinite(itl) or u_rows >= 1:
            return Prediction(INF, itl, INF, min(busy, 1.0))
        # Capacity: the prompts get the time the rows leave (a late prompt's chunks grow past the
        # ITL bound, so under load the lane runs at full speed).
        lane = alone / (1 - u_rows)
        rho = (lam * lane + c.local_token_s * backlog_rate / (1 - u_rows)) / d
        # Latency: with rows running (probability 1 - e^-R), the ITL bound spreads a prompt out.
        rows = lam * lo * itl / d
        spread = c.local_token_s * li
        if self.itl_factor > 1:
            spread *= self.itl_factor / (self.itl_factor - 1)
        if self.ttft_target_s > 0:
            spread = min(spread, max(self.ttft_target_s, c.local_token_s * li))
        p_rows = 1 - math.exp(-rows)
        service = p_rows * (c.decode_base_s + spread) + (1 - p_rows) * alone
        ttft = service + self._wait(rho, lane) if rho < 1 else INF
        return Prediction(ttft, itl, rho, min(busy, 1.0))

    def _wait(self, rho: float, service: float) -> float:
        if rho <= 0:
            return 0.0
        return wait_quantile(md1_wait(rho, service), rho, self.quantile)


@dataclass
class Correction:
    """measured / predicted for the running shape, smoothed (in log space, weight `weight` per new
    interval) and clamped to `bounds`; applied to every candidate's prediction."""

    bounds: tuple[float, float] = (0.5, 2.0)
    weight: float = 0.3
    value: float = 1.0
    updates: int = 0          # intervals that moved it

    def update(self, measured: float | None, predicted: float) -> None:
        if measured is None or measured <= 0 or not math.isfinite(predicted) or predicted <= 0:
            return
        self.updates += 1
        lo, hi = self.bounds
        ratio = min(hi, max(lo, measured / predicted))
        self.value = math.exp((1 - self.weight) * math.log(self.value) + self.weight * math.log(ratio))
        self.value = min(hi, max(lo, self.value))
