"""`Planner.step(observation) -> Decision`: which shape serves the next interval's load best.

Per interval: forecast the load (predict.py), learn the correction from how the running shape did
(model.py), predict every candidate shape's TTFT and ITL, and score them. A shape's *headroom* is
`min(1 - TTFT/ttft_slo, 1 - ITL/itl_slo)`; it is feasible when the headroom is at least `headroom`.

- On one host (a fixed number of workers, only their roles change) the best shape is a feasible one
  with the largest mean of the two headrooms (so that at low load, where ITL is far inside its SLO
  for every shape, the better TTFT wins); when none is feasible, the largest (min) headroom.
- Elsewhere (Kubernetes, metrics) the best is the feasible shape with the fewest workers (then the
  largest headroom); when none is feasible, the largest headroom.

Hysteresis: a reshape happens only after the same better shape won `stable_intervals` intervals in a
row by a margin (host: feasible where the running shape is not, or `margin` more of the score;
elsewhere: the running shape is
infeasible and the other feasible, or a smaller shape is feasible with `margin` to spare), and not
within `cooldown_s` of the last reshape; nothing while the actuator is still busy. Every outcome is a
`Decision` (keep / hold / reshape) with a sentence saying why. Torch-free.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

from services.planner.config import PlannerConfig
from services.planner.model import CapacityModel, Correction, Costs, NotFitted, Prediction
from services.planner.observe import Observation
from services.planner.predict import Load, LoadPredictor
from services.planner.shape import Actuator, Decision, Shape


@dataclass(frozen=True)
class Candidate:
    shape: Shape
    prediction: Prediction
    headroom: float            # min over the two SLOs of 1 - predicted/SLO (-inf: cannot keep up)
    mean_headroom: float       # their mean
    feasible: bool

    @property
    def slack(self) -> float:
        """The host's score: a feasible shape's mean headroom (at low load the better TTFT counts even
        when ITL's headroom is the smaller), an infeasible one's min (how far from keeping both)."""
        return self.mean_headroom if self.feasible else self.headroom

    def to_json(self) -> dict:
        def r(x: float) -> float | None:
            return round(x, 4) if math.isfinite(x) else None
        return {**self.prediction.to_json(), "headroom": r(self.headroom), "slack": r(self.slack),
                "feasible": self.feasible}


def observed_shape(obs: Observation) -> Shape | None:
    """What the router sees registered (co-located workers count as decode workers)."""
    decode = obs.workers.get("decode", 0) + obs.workers.get("colocated", 0)
    return Shape(obs.workers.get("prefill", 0), decode) if decode else None


class Planner:
    def __init__(self, cfg: PlannerConfig, actuator: Actuator | None = None, clock=time.time):
        self.cfg = cfg
        self.actuator = actuator
        self.clock = clock
        self.predictor = LoadPredictor(*cfg.smoothing)
        self.ttft_correction = Correction(cfg.correction_bounds, cfg.correction_weight)
        self.itl_correction = Correction(cfg.correction_bounds, cfg.correction_weight)
        self.min_prefill = max(cfg.min_prefill, getattr(actuator, "min_prefill", 0))
        self._streak: tuple[Shape | None, int] = (None, 0)
        self._last_reshape: float | None = None
        self._last_current: Shape | None = None
        self.last_load: Load | None = None
        self.last_best: Candidate | None = None

    # ---- the step ------------------------------------------------------------------------------
    def step(self, obs: Observation) -> Decision:
        now = self.clock()
        current = self.actuator.current() if self.actuator is not None else None
        current = current or observed_shape(obs)
        self.predictor.update(obs)
        load = self.predictor.predict(obs)
        self.last_load = load
        inputs = {"observed": obs.to_json(), "predicted": load.to_json() if load else None,
                  "correction": {"ttft": round(self.ttft_correction.value, 4),
                                 "itl": round(self.itl_correction.value, 4)}}
        busy = self.actuator is not None and self.actuator.busy()
        if current is None:
            return self._decision(now, None, None, "hold", "no decode worker is registered: nothing to plan from",
                                  inputs)
        try:
            costs = Costs.from_roles(obs.step_costs)
        except NotFitted as e:
            return self._decision(now, current, current, "keep", str(e), inputs)
        inputs["costs"] = costs.to_json()
        if not busy and current == self._last_current:   # the interval ran on this shape throughout
            self._learn(costs, current, obs, load)
        self._last_current = current
        if load is None:
            return self._decision(now, current, current, "keep", "no request has finished yet: the load is unknown",
                                  inputs)
        model = self._model(costs)
        candidates = [self._candidate(model, s, load) for s in self.candidates(current)]
        scores = {str(c.shape): c.to_json() for c in candidates}
        incumbent = self._candidate(model, current, load)
        scores.setdefault(str(current), incumbent.to_json())
        best = self._best(candidates, current)
        self.last_best = best
        if busy:
            self._streak = (None, 0)
            return self._decision(now, current, best.shape, "hold", "a reshape is still being applied", inputs,
                                  scores)
        if best.shape == current or not self._better(best, incumbent):
            self._streak = (None, 0)
            why = self._keep_reason(incumbent, best)
            return self._decision(now, current, current, "keep", why, inputs, scores)
        shape, n = self._streak
        n = n + 1 if shape == best.shape else 1
        self._streak = (best.shape, n)
        why = f"{best.shape} is better than {current} ({self._compare(best, incumbent)})"
        if n < self.cfg.stable_intervals:
            return self._decision(now, current, best.shape, "hold", f"{why}, {n} of {self.cfg.stable_intervals} "
                                  "intervals in a row", inputs, scores)
        if self._last_reshape is not None and now - self._last_reshape < self.cfg.cooldown_s:
            left = self.cfg.cooldown_s - (now - self._last_reshape)
            return self._decision(now, current, best.shape, "hold", f"{why}, but the last reshape was "
                                  f"{now - self._last_reshape:.0f} s ago ({left:.0f} s of cooldown left)", inputs, scores)
        self._last_reshape = now
        self._streak = (None, 0)
        return self._decision(now, current, best.shape, "reshape", f"{why} for {n} intervals", inputs, scores)

    # ---- candidates and scores -----------------------------------------------------------------
    def candidates(self, current: Shape) -> list[Shape]:
        """Shapes within the bounds; on one host only those with the running number of workers."""
        cfg = self.cfg
        out = []
        for p in range(self.min_prefill, cfg.max_prefill + 1):
            for d in range(cfg.min_decode, cfg.max_decode + 1):
                if not cfg.fixed_total or p + d == current.workers:
                    out.append(Shape(p, d))
        return out or [current]

    def _model(self, costs: Costs) -> CapacityModel:
        return CapacityModel(costs, self.cfg.slo_quantile, self.cfg.interval_s, self.cfg.mixed_chunk_itl_factor,
                             self.cfg.mixed_chunk_ttft_target_s, self.ttft_correction.value, self.itl_correction.value)

    def _candidate(self, model: CapacityModel, shape: Shape, load: Load) -> Candidate:
        pred = model.predict(shape, load)
        ttft, itl = 1 - pred.ttft_s / self.cfg.ttft_slo_s, 1 - pred.itl_s / self.cfg.itl_slo_s
        headroom = min(ttft, itl)
        return Candidate(shape, pred, headroom, (ttft + itl) / 2, headroom >= self.cfg.headroom)

    def _best(self, candidates: list[Candidate], current: Shape) -> Candidate:
        if self.cfg.fixed_total:   # feasible first, most slack; on a tie the running shape, then fewer prefill
            return max(candidates, key=lambda c: (c.feasible, c.slack, c.shape == current, -c.shape.prefill))
        feasible = [c for c in candidates if c.feasible]
        if feasible:
            return min(feasible, key=lambda c: (c.shape.workers, -c.headroom, c.shape != current))
        return max(candidates, key=lambda c: (c.headroom, c.shape == current, -c.shape.workers))

    def _better(self, best: Candidate, incumbent: Candidate) -> bool:
        """Whether `best` beats the running shape by the margin hysteresis asks for."""
        margin = self.cfg.margin
        if self.cfg.fixed_total:
            return (best.feasible and not incumbent.feasible) or (
                best.feasible == incumbent.feasible and best.slack > incumbent.slack + margin)
        if not incumbent.feasible:
            return best.feasible or best.headroom > incumbent.headroom + margin
        return best.feasible and best.shape.workers < incumbent.shape.workers and \
            best.headroom >= self.cfg.headroom + margin

    @staticmethod
    def _compare(best: Candidate, incumbent: Candidate) -> str:
        def h(c: Candidate) -> str:
            if not math.isfinite(c.headroom):
                return "cannot keep up"
            return f"{c.headroom:+.2f} (mean {c.mean_headroom:+.2f}{'' if c.feasible else ', infeasible'})"
        return f"headroom {h(best)} vs {h(incumbent)}, workers {best.shape.workers} vs {incumbent.shape.workers}"

    def _keep_reason(self, incumbent: Candidate, best: Candidate) -> str:
        state = "meets the SLOs" if incumbent.feasible else "misses the SLOs"
        if best.shape == incumbent.shape:
            return f"{incumbent.shape} {state} and no shape does better ({self._compare(best, incumbent)})"
        return f"{incumbent.shape} {state}; {best.shape} is not better by the margin ({self._compare(best, incumbent)})"

    # ---- learning ------------------------------------------------------------------------------
    def _learn(self, costs: Costs, current: Shape, obs: Observation, load: Load | None) -> None:
        """Update the corrections from what the running shape did this interval, at the load it had."""
        prompt = obs.prompt_tokens if obs.prompt_tokens is not None else (load.prompt_tokens if load else None)
        output = obs.output_tokens if obs.output_tokens is not None else (load.output_tokens if load else None)
        if prompt is None or output is None:
            return
        seen = Load(obs.arrival_rate, prompt, output, obs.queued_prefill_tokens)
        raw = CapacityModel(costs, self.cfg.slo_quantile, self.cfg.interval_s, self.cfg.mixed_chunk_itl_factor,
                            self.cfg.mixed_chunk_ttft_target_s).predict_raw(current, seen)
        if obs.ttft_samples >= self.cfg.min_samples:
            self.ttft_correction.update(obs.quantile("ttft", self.cfg.slo_quantile), raw.ttft_s)
        if obs.itl_samples >= self.cfg.min_samples:
            self.itl_correction.update(obs.itl_mean, raw.itl_s)

    def _decision(self, now: float, current: Shape | None, desired: Shape | None, action: str, reason: str,
                  inputs: dict, scores: dict | None = None) -> Decision:
        return Decision(now, current, desired or current or Shape(self.min_prefill, self.cfg.min_decode), action,
                        reason, inputs, scores or {})
