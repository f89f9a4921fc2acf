"""How long steps take, learned from the steps themselves: the mixed-chunk budget's cost model.

A mixed step runs one prefill chunk beside one token of every running request, so each chunk token
delays every running request's next token. `StepCostModel` keeps two running estimates — a decode
step's time and the marginal time of one prefill token — and turns a bound on that delay ("a mixed
step takes at most `factor` x a decode step") into a token budget for the chunk. Time is measured
by the scheduler between handing out a batch and hearing it finished (torch-free, no device sync).
"""

from __future__ import annotations

from dataclasses import dataclass

_ALPHA = 0.2   # weight of the newest observation: adapts within ~10 steps, smooths out noise


@dataclass
class StepCostModel:
    decode_step_s: float | None = None       # a pure decode step of the current batch
    prefill_token_s: float | None = None     # marginal cost of one prefill token

    def observe(self, prefill_tokens: int, decode_rows: int, seconds: float) -> None:
        if seconds <= 0:
            return
        if prefill_tokens == 0 and decode_rows:
            self.decode_step_s = _ema(self.decode_step_s, seconds)
        elif prefill_tokens and not decode_rows:
            # A whole prefill step also pays the weights' fixed cost: an over-estimate of the
            # marginal cost, which only makes the first mixed chunks smaller than they could be.
            self.prefill_token_s = _ema(self.prefill_token_s, seconds / prefill_tokens)
        elif prefill_tokens and self.decode_step_s is not None:
            extra = seconds - self.decode_step_s
            if extra > 0:
                self.prefill_token_s = _ema(self.prefill_token_s, extra / prefill_tokens)

    def prefill_budget(self, factor: float, floor: int, cap: int) -> int:
        """Most chunk tokens that keep a mixed step within `factor` x a decode step (`cap` while
        nothing is known yet or `factor` is 0; never below `floor`, so prompts still progress)."""
        if not factor or self.decode_step_s is None or not self.prefill_token_s:
            return cap
        tokens = int((factor - 1.0) * self.decode_step_s / self.prefill_token_s)
        return max(floor, min(cap, tokens))


def _ema(old: float | None, new: float) -> float:
    return new if old is None else (1 - _ALPHA) * old + _ALPHA * new
