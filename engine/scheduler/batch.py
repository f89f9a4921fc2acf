"""What the scheduler hands the model runner for one step (torch-free)."""

from __future__ import annotations

from dataclasses import dataclass

from tandem.engine.scheduler.request import Request


@dataclass
class SeqStep:
    """One sequence's part of a step: run `input_ids` after `prefix_len` tokens already in the pool."""

    req: Request
    input_ids: list[int]
    prefix_len: int
    sample: bool                   # False for a prefill chunk that is not the prompt's last
    # Future-map slot that receives this sequence's sampled token (set when the step is committed);
    # an input id < 0 refers to such a slot of the previous step (see engine/scheduler/future.py).
    future: int = -1
    decode: bool = False           # one token of a running request (not a prefill chunk)
    # Speculative decoding: the last `num_drafts` of `input_ids` are draft tokens to verify; the
    # step then yields up to num_drafts + 1 tokens for this sequence (engine/spec/).
    num_drafts: int = 0


@dataclass
class StepBatch:
    seqs: list[SeqStep]
    scheduled_at: float = 0.0      # perf_counter when the scheduler committed it

    @property
    def has_future_inputs(self) -> bool:
        return any(t < 0 for s in self.seqs for t in s.input_ids)

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
