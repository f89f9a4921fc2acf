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
`Decision` (keep / hold / reshape) with a sentence saying why.

What a shape did beats what the formulas say: every whole interval a shape runs is remembered (its
load and measured TTFT quantile and mean ITL, the last `MEMORY` intervals); a shape asked about at a
load close to ones it ran at (rate within 20%, prompt and output lengths within 30%) is predicted by
the mean of those measurements, not the formulas. So the running shape is judged by what it is
doing (the formulas may call 1P1D saturated at 3 req/s while the router's local route keeps it
within its SLO), and a shape tried once is judged by what it did.

Corrections are kept per shape: each is learned only while its shape runs, and a shape that never ran
borrows the running shape's. So a shape the formulas flatter is tried once, measured, and from then
on judged by what it did. Going back to the shape the last reshape left is not held by the cooldown
once the new shape has run `stable_intervals` intervals, its own correction came out `REGRET` times
the one it was chosen with, and the old one scores better (a measured regret, not a forecast): a move the model got wrong costs one trial, not a
cooldown. Torch-free.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

from tandem.services.planner.config import PlannerConfig
from tandem.services.planner.model import CapacityModel, Correction, Costs, NotFitted, Prediction
from tandem.services.planner.observe import Observation
from tandem.services.planner.predict import Load, LoadPredictor
from tandem.services.planner.shape import Actuator, Decision, Shape

# A running shape whose own measured/predicted ratio is this many times the one it was chosen with
# measured worse than the forecast that moved to it.
REGRET = 1.25
MEMORY = 6                      # intervals remembered per shape
CLOSE_RATE, CLOSE_LENGTHS = 0.2, 0.3


def close(a: Load, b: Load) -> bool:
    """Loads near enough that one's measurement stands for the other."""
    def near(x: float, y: float, rel: float, floor: float) -> bool:
        return abs(x - y) <= rel * max(x, y, floor)
    return near(a.rate, b.rate, CLOSE_RATE, 0.1) and near(a.prompt_tokens, b.prompt_tokens, CLOSE_LENGTHS, 16) \
        and near(a.output_tokens, b.output_tokens, CLOSE_LENGTHS, 16)


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
        # measured/predicted per shape, learned only while that shape runs
        self.corrections: dict[Shape, tuple[Correction, Correction]] = {}
        self._intervals_on = 0          # intervals the running shape has run whole since it started
        self._left: Shape | None = None  # the shape the last reshape moved away from
        self.memory: dict[Shape, list[tuple[Load, float, float]]] = {}   # (load, TTFT quantile, ITL) per interval
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
        busy = self.actuator is not None and self.actuator.busy()
        inputs = {"observed": obs.to_json(), "predicted": load.to_json() if load else None}
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
            self._intervals_on += 1
        elif current != self._last_current:
            self._intervals_on = 0
        self._last_current = current
        inputs["correction"] = {str(k): {"ttft": round(t.value, 4), "itl": round(i.value, 4), "intervals": max(t.updates, i.updates)}
                                for k, (t, i) in self.corrections.items()}
        if load is None:
            return self._decision(now, current, current, "keep", "no request has finished yet: the load is unknown",
                                  inputs)
        candidates = [self._candidate(self._model(costs, s, current), s, load) for s in self.candidates(current)]
        scores = {str(c.shape): c.to_json() for c in candidates}
        incumbent = self._candidate(self._model(costs, current, current), current, load)
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
        regret = self._regret(best.shape)
        if regret:
            why = f"{why}: {current} measured worse than predicted in its {self._intervals_on} intervals, back to " \
                  f"the shape it replaced without waiting for the cooldown"
        elif self._last_reshape is not None and now - self._last_reshape < self.cfg.cooldown_s:
            left = self.cfg.cooldown_s - (now - self._last_reshape)
            return self._decision(now, current, best.shape, "hold", f"{why}, but the last reshape was "
                                  f"{now - self._last_reshape:.0f} s ago ({left:.0f} s of cooldown left)", inputs, scores)
        self._last_reshape = now
        self._streak = (None, 0)
        self._left = None if regret else current   # one regret per move: going back is not itself undone early
        return self._decision(now, current, best.shape, "reshape", f"{why} for {n} intervals", inputs, scores)

    def _regret(self, shape: Shape) -> bool:
        """Back to the shape the last reshape left, once the running one has run `stable_intervals` and
        its own correction (TTFT or ITL) came out `REGRET` times the one it was chosen with, the left
        shape's, which stays as it was while that shape does not run."""
        if shape != self._left or self._intervals_on < self.cfg.stable_intervals:
            return False
        running = self.corrections.get(self._last_current)
        if running is None:
            return False
        chosen_with = self.correction(self._left)
        return any(own.updates and own.value >= REGRET * old.value for own, old in zip(running, chosen_with, strict=True))

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

    def measured(self, shape: Shape) -> bool:
        """`shape` has run and learned its own corrections."""
        own = self.corrections.get(shape)
        return own is not None and own[0].updates + own[1].updates > 0

    def correction(self, shape: Shape, current: Shape | None = None) -> tuple[Correction, Correction]:
        """`shape`'s own corrections once it has run. Before that the running shape's if both are of one
        kind (both with prefill workers, or both co-located: what the formulas leave out, e.g. the
        router's local route when P > 0, is alike within a kind and not across), else none (1.0)."""
        if self.measured(shape):
            return self.corrections[shape]
        borrowed = self.corrections.get(current) if current is not None else None
        if borrowed is not None and shape.colocated == current.colocated:
            return borrowed
        return self._fresh()

    def _fresh(self) -> tuple[Correction, Correction]:
        """(TTFT, ITL) corrections that have learned nothing yet."""
        return (Correction(self.cfg.correction_bounds, self.cfg.correction_weight),
                Correction(self.cfg.correction_bounds, self.cfg.correction_weight))

    def _model(self, costs: Costs, shape: Shape, current: Shape | None) -> CapacityModel:
        ttft, itl = self.correction(shape, current)
        return CapacityModel(costs, self.cfg.slo_quantile, self.cfg.interval_s, self.cfg.mixed_chunk_itl_factor,
                             self.cfg.mixed_chunk_ttft_target_s, ttft.value, itl.value)

    def measured_at(self, shape: Shape, load: Load) -> tuple[float, float] | None:
        """Mean TTFT quantile and ITL `shape` measured at loads close to `load` (None: never there)."""
        seen = [(t, i) for at, t, i in self.memory.get(shape, ()) if close(at, load)]
        if not seen:
            return None
        return sum(t for t, _ in seen) / len(seen), sum(i for _, i in seen) / len(seen)

    def _candidate(self, model: CapacityModel, shape: Shape, load: Load) -> Candidate:
        pred = model.predict(shape, load)
        measured = self.measured_at(shape, load)
        if measured is not None:
            pred = Prediction(measured[0], measured[1], pred.prefill_util, pred.decode_util, measured=True)
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
        """Whether `best` beats the running shape by the margin hysteresis asks for (twice it for a
        shape that never ran: its forecast has no measurement behind it)."""
        margin = self.cfg.margin * (1 if self.measured(best.shape) else 2)
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
        ttft, itl = self.corrections.setdefault(current, self._fresh())
        measured_ttft = obs.quantile("ttft", self.cfg.slo_quantile)
        if obs.ttft_samples >= self.cfg.min_samples:
            ttft.update(measured_ttft, raw.ttft_s)
        if obs.itl_samples >= self.cfg.min_samples:
            itl.update(obs.itl_mean, raw.itl_s)
        if obs.ttft_samples >= self.cfg.min_samples and obs.itl_samples >= self.cfg.min_samples \
                and measured_ttft is not None and obs.itl_mean is not None:
            kept = self.memory.setdefault(current, [])
            kept.append((seen, measured_ttft, obs.itl_mean))
            del kept[:-MEMORY]

    def _decision(self, now: float, current: Shape | None, desired: Shape | None, action: str, reason: str,
                  inputs: dict, scores: dict | None = None) -> Decision:
        return Decision(now, current, desired or current or Shape(self.min_prefill, self.cfg.min_decode), action,
                        reason, inputs, scores or {})
