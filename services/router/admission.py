"""The router's admission: at most `max_inflight` requests are routed at once; up to `max_queued` more
wait for a slot in the queue policy's order (engine/scheduler/queue_policy.py: priority, then
arrival). A full queue turns away at once, with RESOURCE_EXHAUSTED, whoever would be served last.
With `max_queued` 0 nothing waits: a request beyond `max_inflight` is refused (the old behaviour).

Runs on the router's asyncio loop only (no locks). Every `acquire` that returns is paired with one
`release`; a waiter that is cancelled or times out leaves no slot behind.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from engine.errors import ResourceExhausted
from engine.scheduler.queue_policy import PolicyQueue, QueuePolicy


@dataclass(eq=False)
class _Waiter:
    priority: int
    future: asyncio.Future
    arrival: float = field(default_factory=time.monotonic)


class Admission:
    def __init__(self, max_inflight: int, max_queued: int, policy: QueuePolicy):
        self.max_inflight = max_inflight
        self.max_queued = max_queued
        self.policy = policy
        self.inflight = 0
        self.queue: PolicyQueue[_Waiter] = PolicyQueue(policy)

    async def acquire(self, priority: int = 0) -> None:
        """Take an in-flight slot, waiting in the queue if needed. Raises ResourceExhausted."""
        if self.inflight < self.max_inflight and not self.queue:
            self.inflight += 1
            return
        if self.max_queued == 0:
            raise ResourceExhausted(f"router has {self.inflight} requests in flight (--max-inflight "
                                    f"{self.max_inflight}); retry later")
        me = _Waiter(priority, asyncio.get_running_loop().create_future())
        out = self.queue.offer(me, self.max_queued)
        if out is me:
            raise ResourceExhausted(self.policy.queue_full_message("router queue", self.max_queued, me))
        if out is not None:
            out.future.set_exception(ResourceExhausted(
                self.policy.evicted_message("router queue", self.max_queued, out, me)))
        try:
            await me.future  # resolved by `release`, which hands its slot over
        except asyncio.CancelledError:
            if me in self.queue:
                self.queue.remove(me)
            elif me.future.done() and not me.future.cancelled() and me.future.exception() is None:
                self.release()  # the slot arrived as we were cancelled: pass it on
            raise

    def release(self) -> None:
        while self.queue:
            waiter = self.queue.popleft()
            if not waiter.future.done():
                waiter.future.set_result(None)  # the slot moves to it: `inflight` is unchanged
                return
        self.inflight -= 1
        assert self.inflight >= 0, "Admission.release without acquire"
