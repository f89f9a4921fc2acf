"""What the scheduler hands the model runner for one step (torch-free)."""

from __future__ import annotations

from dataclasses import dataclass

from engine.scheduler.request import Request


@dataclass
class SeqStep:
    """One sequence's part of a step: run `input_ids` after `prefix_len` tokens already in the pool."""

    req: Request
    input_ids: list[int]
    prefix_len: int
    sample: bool                   # False for a prefill chunk that is not the prompt's last


@dataclass
class StepBatch:
    seqs: list[SeqStep]

    @property
    def is_decode(self) -> bool:
        return all(len(s.input_ids) == 1 for s in self.seqs)

    @property
    def num_tokens(self) -> int:
        return sum(len(s.input_ids) for s in self.seqs)

    @property
    def sampling(self) -> list[SeqStep]:
        return [s for s in self.seqs if s.sample]


@dataclass
class SampledToken:
    token_id: int
    logprob: float | None = None
    top: list[tuple[int, float]] | None = None
