"""A request's bookkeeping inside a worker (torch-free)."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

from tandem.engine.outputs import FinishReason
from tandem.engine.sampling_params import SamplingParams
from tandem.engine.scheduler.future import future_ref


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    PREFILLING = "prefilling"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    arrival: float = field(default_factory=time.monotonic)
    priority: int = 0                # see engine/scheduler/queue_policy.py (ignored unless enabled)
    output_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    # KV bookkeeping, owned by KVManager. `pages` cover `num_computed` tokens of `all_ids` (plus
    # room reserved ahead); the first `cache_len` tokens came from the prefix cache via `cache_node`.
    slot: int | None = None
    pages: list[int] = field(default_factory=list)
    cache_node: Any = None
    cache_len: int = 0
    num_computed: int = 0
    # Tokens that must have KV before the next sampling: the prompt, plus (after a retraction)
    # everything generated so far. Fixed at admission.
    fill_len: int = 0
    # Prompt tokens a prefill worker served from its prefix cache (disaggregated decode); reported
    # as the request's cached tokens instead of this worker's own prefix hit.
    prefill_cached_tokens: int | None = None
    finish_reason: FinishReason | None = None
    num_retractions: int = 0
    first_token_time: float | None = None
    # Overlap scheduling: a token sampled by a batch still running (at most one when the next batch
    # is scheduled), not yet in `output_ids`; `future` is its index in the runner's future-token map.
    num_inflight: int = 0
    future: int = -1
    # Structured output: the request's matcher (engine/structured/matcher.py RequestGrammar), which
    # has consumed exactly `output_ids` once a step's tokens are recorded; None: free text.
    grammar: Any = None
    # LoRA: the request's adapter (engine/lora/adapters.py LoraAdapter); None: the base model.
    lora: Any = None
    # Another worker's pool that holds more of the prompt than this one (engine/kvcache/kv_manager.py
    # PrefixSource): admission fetches those pages instead of computing them. `fetched_tokens`: how
    # many prompt tokens it did fetch.
    kv_source: Any = None
    fetched_tokens: int = 0

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def is_prefilling(self) -> bool:
        return self.num_computed < self.fill_len

    @property
    def remaining_tokens(self) -> int:
        return self.params.max_tokens - len(self.output_ids) - self.num_inflight

    @property
    def next_input(self) -> int:
        """The token a decode step feeds for this request: its newest one, or a reference to the
        future-token map when that token is still being sampled (see engine/scheduler/batch.py)."""
        return future_ref(self.future) if self.num_inflight else self.all_ids[-1]

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens whose KV was not computed for this request (the client-visible cache hit)."""
        return self.cache_len if self.prefill_cached_tokens is None else self.prefill_cached_tokens

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED
