"""Who gets a step's prefill token budget first (torch-free).

With `fcfs` the budget goes to prompts already being prefilled, in the order they started, then to
waiting prompts in queue order: one long prompt takes every chunk until it is done and a 20-token
prompt behind it waits for all of them. `shortest-first` (the default) serves the prompts with the
fewest tokens left to compute first, prefilling or waiting alike, so a short prompt is prefilled in
the next step beside the long one's (smaller) chunk. Starvation is bounded by age: a prompt that
arrived more than `max_wait_s` ago goes ahead of every younger one, oldest first, so a long prompt
under a stream of short ones still finishes. Priorities (queue_policy) come before both rules.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from tandem.engine.config import PREFILL_SCHEDULE_POLICIES
from tandem.engine.scheduler.queue_policy import QueuePolicy
from tandem.engine.scheduler.request import Request, RequestStatus


@dataclass(frozen=True)
class PrefillOrder:
    policy: str = "shortest-first"
    max_wait_s: float = 2.0

    def __post_init__(self) -> None:
        assert self.policy in PREFILL_SCHEDULE_POLICIES, self.policy

    def order(self, prefilling: Iterable[Request], waiting: Iterable[Request], queue: QueuePolicy,
              now: float) -> list[Request]:
        """Prefilling then waiting requests, in the order they are offered the budget. `waiting`
        comes in its queue's order; requests still waiting must be admitted before they compute."""
        prefilling, waiting = list(prefilling), list(waiting)
        if self.policy == "fcfs":
            return prefilling + waiting

        def key(r: Request) -> tuple:
            overdue = now - r.arrival >= self.max_wait_s
            rest = len(r.all_ids) if r.status is RequestStatus.WAITING else r.fill_len - r.num_computed
            # Overdue requests by arrival (the oldest first), the others by work left.
            return (-queue.urgency(r), not overdue, r.arrival if overdue else rest, r.arrival)

        return sorted(prefilling + waiting, key=key)


def tokens_to_prefill(prefilling: Iterable[Request], waiting: Iterable[Request]) -> int:
    """Prompt tokens a worker still has to compute (what the router balances prefill work by);
    waiting requests count in full, as their prefix-cache hit is not known before admission."""
    return sum(r.fill_len - r.num_computed for r in prefilling) + sum(len(r.all_ids) for r in waiting)
