"""What the harness sends (`BenchRequest`) and what it saw come back (`RequestRecord`)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class BenchRequest:
    """One prompt of a workload.

    `prompt_ids` is set when the dataset knows the exact tokens: `prompt` then encodes to exactly
    those ids with the workload's tokenizer (no special tokens added), so a text API and a token-id
    API see the same prompt.
    """

    prompt: str
    prompt_len: int
    output_len: int
    prompt_ids: tuple[int, ...] | None = None
    priority: int | None = None          # sent as the request's `priority` when set (--priority-mix)
    # A chat history, (role, content) pairs ending with the user's turn: what a chat endpoint is sent
    # instead of `prompt` (multi-turn); `prompt` is then the same contents concatenated.
    messages: tuple[tuple[str, str], ...] | None = None
    phase: int | None = None             # --load-profile: the index of the phase it was sent in
    model: str | None = None             # sent as the request's model instead of the backend's (a LoRA adapter)


@dataclass
class RequestRecord:
    """Client-side timeline of one request; times are `time.perf_counter()` seconds.

    A *token event* is one streamed chunk that carried generated output (one token on Tandem and
    on most servers; a server that batches several tokens per chunk yields fewer, longer gaps).
    """

    prompt_len: int
    output_len: int                      # requested max tokens
    start: float = 0.0                   # request sent
    end: float = 0.0                     # stream finished (or failed)
    token_times: list[float] = field(default_factory=list)
    output_tokens: int = 0               # server-reported when it says so, else counted events
    cached_tokens: int = 0               # prompt tokens the server reports as served from its prefix cache
    success: bool = False
    error: str = ""
    priority: int | None = None          # the request's priority class, if the workload sets one
    output_text: str = ""                # the generated text as streamed (a multi-turn answer goes into the next turn)
    conversation: int | None = None      # multi-turn: which conversation (0-based) and which turn (1-based)
    turn: int | None = None
    phase: int | None = None             # --load-profile: the phase it was sent in

    @property
    def ttft(self) -> float | None:
        return self.token_times[0] - self.start if self.token_times else None

    @property
    def e2e(self) -> float:
        return self.end - self.start

    @property
    def itl(self) -> list[float]:
        t = self.token_times
        return [b - a for a, b in zip(t, t[1:], strict=False)]

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first: (E2E - TTFT) / (output tokens - 1)."""
        if self.ttft is None or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)

    def to_dict(self, t0: float) -> dict:
        """JSON form, times in ms, `sent_ms` relative to the benchmark's start `t0`."""
        ms = 1e3
        phase = {} if self.phase is None else {"phase": self.phase}   # only in load-profile runs
        return {
            **phase,
            "sent_ms": round((self.start - t0) * ms, 3),
            "prompt_len": self.prompt_len,
            "output_len": self.output_len,
            "priority": self.priority,
            "conversation": self.conversation,
            "turn": self.turn,
            "output_tokens": self.output_tokens,
            "cached_tokens": self.cached_tokens,
            "success": self.success,
            "error": self.error,
            "ttft_ms": None if self.ttft is None else round(self.ttft * ms, 3),
            "tpot_ms": None if self.tpot is None else round(self.tpot * ms, 3),
            "e2e_ms": round(self.e2e * ms, 3),
            "itl_ms": [round(x * ms, 3) for x in self.itl],
        }
