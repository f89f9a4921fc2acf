"""Speculative decoding's counters as Prometheus metrics: an engine-thread step observer that exports
what `engine.spec.stats` gained since the previous step (torch-free)."""

from __future__ import annotations

from tandem.services.worker import metrics


class SpecMetrics:
    def __init__(self, spec):
        self.spec = spec          # engine/spec/speculator.Speculator
        self._drafted = self._accepted = 0
        self._lengths = [0] * len(spec.stats.accept_lengths)

    def before_step(self) -> None:
        pass

    def after_step(self, elapsed_s: float) -> None:
        s = self.spec.stats
        metrics.SPEC_DRAFT_TOKENS.inc(s.drafted_tokens - self._drafted)
        metrics.SPEC_ACCEPTED_TOKENS.inc(s.accepted_tokens - self._accepted)
        self._drafted, self._accepted = s.drafted_tokens, s.accepted_tokens
        for n, count in enumerate(s.accept_lengths):
            new = count - self._lengths[n]
            if new:
                metrics.SPEC_VERIFIED_ROWS.inc(new)
                for _ in range(new):
                    metrics.SPEC_ACCEPT_LENGTH.observe(n)
                self._lengths[n] = count
        metrics.SPEC_ENABLED.set(1.0 if self.spec.gate.enabled else 0.0)
