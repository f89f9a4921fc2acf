"""The next interval's load: Holt's double exponential smoothing of arrival rate and lengths.

Each series keeps a level and a trend; an interval's value moves the level by `alpha` and the trend
by `beta`, and the forecast one interval ahead is level + trend, never below 0. A ramp is therefore
met a step ahead instead of an interval late, and a single spike moves the forecast only by `alpha`.
An interval where no request finished says nothing about lengths: those series keep their forecast.
Torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass

from tandem.services.planner.observe import Observation


@dataclass(frozen=True)
class Load:
    """What the capacity model is asked about."""

    rate: float                 # requests/s
    prompt_tokens: float        # mean tokens per prompt
    output_tokens: float        # mean tokens per answer
    backlog_tokens: float = 0.0  # prompt tokens queued now (prefilled within the coming interval)

    def to_json(self) -> dict:
        return {"rate": round(self.rate, 4), "prompt_tokens": round(self.prompt_tokens, 1),
                "output_tokens": round(self.output_tokens, 1), "backlog_tokens": round(self.backlog_tokens, 1)}


class Holt:
    def __init__(self, alpha: float, beta: float):
        assert 0 < alpha <= 1 and 0 <= beta <= 1
        self.alpha, self.beta = alpha, beta
        self.level: float | None = None
        self.trend = 0.0

    def update(self, x: float) -> None:
        if self.level is None:
            self.level = x
            return
        prev = self.level
        self.level = self.alpha * x + (1 - self.alpha) * (prev + self.trend)
        self.trend = self.beta * (self.level - prev) + (1 - self.beta) * self.trend

    def forecast(self, steps: int = 1) -> float | None:
        return None if self.level is None else max(0.0, self.level + steps * self.trend)


class LoadPredictor:
    def __init__(self, alpha: float = 0.5, beta: float = 0.3):
        self.rate, self.prompt, self.output = Holt(alpha, beta), Holt(alpha, beta), Holt(alpha, beta)

    def update(self, obs: Observation) -> None:
        self.rate.update(obs.arrival_rate)
        if obs.prompt_tokens is not None:
            self.prompt.update(obs.prompt_tokens)
        if obs.output_tokens is not None:
            self.output.update(obs.output_tokens)

    def predict(self, obs: Observation) -> Load | None:
        """Next interval's load (None until a request finished: lengths unknown). The backlog is the
        queue observed now, not forecast."""
        rate, prompt, output = self.rate.forecast(), self.prompt.forecast(), self.output.forecast()
        if rate is None or prompt is None or output is None:
            return None
        return Load(rate, prompt, output, obs.queued_prefill_tokens)
