"""Typed requests and results of the Tandem client; the SDK's only wire conversions live in `_convert`."""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field

from tandem_client.structured import Structured


class FinishReason(enum.StrEnum):
    LENGTH = "length"   # max_tokens reached
    STOP = "stop"       # EOS, a stop token id or a stop string
    ABORT = "abort"     # the server aborted the request
    GRAMMAR_DEAD_END = "grammar_dead_end"  # `structured`: no legal token was left; the text is not a complete value


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens and when to stop. The server validates values (errors name the field).

    temperature 0 is greedy; top_k < 0 disables top-k; `seed` makes sampling reproducible. The five
    fields left at None take the server's defaults: the model's `generation_config.json` where it sets
    them, else OpenAI's -- temperature 1 (sampling; pass temperature=0 for greedy), no top-p, top-k,
    min-p or repetition penalty -- the same rule as the HTTP API's. `structured`: what
    the output must match (tandem_client.structured), None for free text.
    """

    max_tokens: int = 16
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    seed: int | None = None
    stop: Sequence[str] = ()
    stop_token_ids: Sequence[int] = ()
    ignore_eos: bool = False
    logprobs: bool = False
    top_logprobs: int = 0
    skip_special_tokens: bool = True
    structured: Structured | None = None


@dataclass(frozen=True)
class TopLogprob:
    token_id: int
    logprob: float
    token: str = ""


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: tuple[TopLogprob, ...] = ()


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(frozen=True)
class StreamChunk:
    """New tokens since the previous chunk and the text they complete (never a broken UTF-8 character).

    `finish_reason`, `matched_stop` and `usage` are set on the last chunk only. `matched_stop` is
    what ended a STOP, as vLLM's `stop_reason`: the stop string, the `stop_token_ids` entry (an int),
    or None when the model's end-of-sequence token did.
    """

    request_id: str
    text: str
    token_ids: tuple[int, ...] = ()
    logprobs: tuple[TokenLogprob, ...] = ()
    finish_reason: FinishReason | None = None
    matched_stop: str | int | None = None
    usage: Usage | None = None


@dataclass
class GenerateResult:
    """A whole generation: the chunks of a stream, merged."""

    request_id: str = ""
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    matched_stop: str | int | None = None
    usage: Usage | None = None

    def add(self, chunk: StreamChunk) -> None:
        self.request_id = self.request_id or chunk.request_id
        self.text += chunk.text
        self.token_ids.extend(chunk.token_ids)
        self.logprobs.extend(chunk.logprobs)
        if chunk.finish_reason is not None:
            self.finish_reason = chunk.finish_reason
            self.matched_stop = chunk.matched_stop
        if chunk.usage is not None:
            self.usage = chunk.usage


@dataclass(frozen=True)
class ModelInfo:
    id: str
    max_context_len: int
    vocab_size: int


@dataclass(frozen=True)
class RetryPolicy:
    """Retries of a call that failed with UNAVAILABLE before its first chunk (never after: the
    server may already have generated tokens). Delays grow exponentially, with full jitter."""

    max_attempts: int = 4           # 1 = no retry
    initial_backoff_s: float = 0.1
    max_backoff_s: float = 2.0
    multiplier: float = 2.0

    def __post_init__(self) -> None:
        if self.max_attempts < 1 or self.initial_backoff_s < 0 or self.max_backoff_s < 0 or self.multiplier < 1:
            raise ValueError(f"invalid retry policy: {self}")

    def backoff(self, attempt: int) -> float:
        """Upper bound of the delay before attempt `attempt + 1` (attempt counts from 1)."""
        return min(self.max_backoff_s, self.initial_backoff_s * self.multiplier ** (attempt - 1))


NO_RETRY = RetryPolicy(max_attempts=1)


@dataclass(frozen=True)
class TLSConfig:
    """Server-authenticated TLS (root_certificates None = the system's roots), or mutual TLS with
    private_key + certificate_chain. `server_name` overrides the name checked against the certificate."""

    root_certificates: bytes | None = None
    private_key: bytes | None = None
    certificate_chain: bytes | None = None
    server_name: str | None = None
