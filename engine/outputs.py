"""What the engine hands back to callers (torch-free)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


class FinishReason(enum.Enum):
    LENGTH = "length"
    STOP = "stop"
    ABORT = "abort"
    # Structured output that can neither go on nor end: the text is not a complete value.
    GRAMMAR_DEAD_END = "grammar_dead_end"


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0


@dataclass
class RequestOutput:
    """One streamed delta: the tokens and text produced since the previous delta of this request."""

    rid: str
    token_ids: list[int]
    text: str
    logprobs: list[TokenLogprob] | None = None
    finish_reason: FinishReason | None = None
    # What ended a STOP (vLLM's `stop_reason`): the stop string, the stop_token_ids entry, or None
    # when the model's EOS did (and for LENGTH/ABORT).
    matched_stop: str | int | None = None
    usage: Usage | None = None     # set on the final delta

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class GenerationResult:
    """A whole generation, as `LLMEngine.generate` returns it."""

    rid: str
    text: str
    token_ids: list[int]
    finish_reason: FinishReason
    usage: Usage
    logprobs: list[TokenLogprob] | None = None
    matched_stop: str | int | None = None
