"""What a worker's scheduler holds at one moment, for metrics and load reports (torch-free)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SchedulerStats:
    waiting: int          # queued requests not yet admitted
    prefilling: int       # admitted requests whose prompt is still being computed
    running: int          # requests decoding
    prefill_tokens: int   # prompt tokens still to compute, queued ones in full (tokens_to_prefill)
    free_pages: int       # KV pages obtainable now: free plus evictable from the prefix cache
    total_pages: int
    free_slots: int       # request slots
