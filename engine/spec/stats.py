"""Counters of speculative decoding, read by the worker's metrics (torch-free)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecStats:
    num_draft_tokens: int                     # k: the histogram has k + 1 buckets
    drafted_tokens: int = 0                   # drafts verified
    accepted_tokens: int = 0                  # drafts accepted
    emitted_tokens: int = 0                   # tokens verify steps produced (accepted + one per row)
    verify_steps: int = 0                     # steps that verified drafts
    plain_steps: int = 0                      # decode steps without drafts (nothing proposed, or gated off)
    # accept_lengths[n]: verified rows that accepted n drafts (acceptance length histogram)
    accept_lengths: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.accept_lengths:
            self.accept_lengths = [0] * (self.num_draft_tokens + 1)

    def record_row(self, drafted: int, accepted: int) -> None:
        self.drafted_tokens += drafted
        self.accepted_tokens += accepted
        self.emitted_tokens += accepted + 1
        self.accept_lengths[accepted] += 1

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else 0.0

    @property
    def mean_accept_length(self) -> float:
        """Tokens per verified row per step (1 + accepted drafts), SGLang's 'accept length'."""
        rows = sum(self.accept_lengths)
        return self.emitted_tokens / rows if rows else 0.0
