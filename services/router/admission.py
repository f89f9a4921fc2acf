"""The router's admission: at most `max_inflight` requests are routed at once; up to `max_queued` more
wait for a slot, served by the queue policy (engine/scheduler/queue_policy.py): priority first, then
the earliest deadline, then arrival. A waiter's deadline is its own (the gRPC deadline or the router's
request timeout), else its arrival + `queue_timeout_s`.

Shedding, always with RESOURCE_EXHAUSTED (HTTP 429) and at once rather than as a timeout later:
- a full queue turns away whoever would be served last (the newcomer in FIFO; with priorities the
  lowest priority, then the latest deadline);
- a waiter that can no longer start in time: its deadline passed while it queued, or it waited
  `queue_timeout_s` (0: no bound but the deadline). While capacity changes (a worker drains, restarts
  in another role) this keeps the queue to requests that can still meet their SLO, instead of
  serving every request late.
With `max_queued` 0 nothing waits: a request beyond `max_inflight` is refused.

Runs on the router's asyncio loop only (no locks). Every `acquire` that returns is paired with one
`release`; a waiter that is shed, cancelled or times out leaves no slot and no timer behind.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from tandem.engine.errors import ResourceExhausted
from tandem.engine.scheduler.queue_policy import PolicyQueue, QueuePolicy


@dataclass(eq=False)
class _Waiter:
    priority: int
    future: asyncio.Future
    arrival: float = field(default_factory=time.monotonic)
    deadline: float = math.inf    # monotonic s: the order among equal priorities (earliest first)
    shed_at: float = math.inf     # monotonic s: when it can no longer start in time
    timer: asyncio.TimerHandle | None = None


class Admission:
    def __init__(self, max_inflight: int, max_queued: int, policy: QueuePolicy, queue_timeout_s: float = 0.0,
                 on_shed: Callable[[], None] = lambda: None):
        self.max_inflight = max_inflight
        self.max_queued = max_queued
        self.policy = policy
        self.queue_timeout_s = queue_timeout_s
        self.on_shed = on_shed        # a metric: called once per waiter shed for lateness
        self.inflight = 0
        self.shed = 0                 # waiters shed because they could no longer start in time
        self.queue: PolicyQueue[_Waiter] = PolicyQueue(policy, order=lambda w: w.deadline)

    async def acquire(self, priority: int = 0, deadline: float | None = None, arrival: float | None = None) -> None:
        """Take an in-flight slot, waiting in the queue if needed. `deadline`: the request's own
        (time.monotonic() seconds), None for none; `arrival`: when it reached the router (default:
        now). Raises ResourceExhausted when turned away or shed."""
        if self.inflight < self.max_inflight and not self.queue:
            self.inflight += 1
            return
        if self.max_queued == 0:
            raise ResourceExhausted(f"router has {self.inflight} requests in flight (--max-inflight "
                                    f"{self.max_inflight}); retry later")
        me = self._waiter(priority, deadline, arrival)
        if time.monotonic() >= me.shed_at:
            self._count_shed()
            raise ResourceExhausted(self._late_message(me))
        out = self.queue.offer(me, self.max_queued)
        if out is me:
            raise ResourceExhausted(self.policy.queue_full_message("router queue", self.max_queued, me))
        if out is not None:
            self._leave(out, ResourceExhausted(self.policy.evicted_message("router queue", self.max_queued, out, me)))
        if me.shed_at < math.inf:
            me.timer = asyncio.get_running_loop().call_later(me.shed_at - time.monotonic(), self._expire, me)
        try:
            await me.future  # resolved by `release`, which hands its slot over
        except asyncio.CancelledError:
            if me in self.queue:
                self.queue.remove(me)
            elif me.future.done() and not me.future.cancelled() and me.future.exception() is None:
                self.release()  # the slot arrived as we were cancelled: pass it on
            raise
        finally:
            if me.timer is not None:
                me.timer.cancel()

    def release(self) -> None:
        now = time.monotonic()
        while self.queue:
            waiter = self.queue.popleft()
            if waiter.future.done():
                continue
            if now >= waiter.shed_at:  # its timer has not run yet: it could not start in time either
                self._count_shed()
                self._leave(waiter, ResourceExhausted(self._late_message(waiter)), queued=False)
                continue
            waiter.future.set_result(None)  # the slot moves to it: `inflight` is unchanged
            return
        self.inflight -= 1
        assert self.inflight >= 0, "Admission.release without acquire"

    # ---- waiters -----------------------------------------------------------------------------

    def _waiter(self, priority: int, deadline: float | None, arrival: float | None) -> _Waiter:
        now = time.monotonic()
        arrival = now if arrival is None else arrival
        bound = arrival + self.queue_timeout_s if self.queue_timeout_s > 0 else math.inf
        own = math.inf if deadline is None else deadline
        return _Waiter(priority, asyncio.get_running_loop().create_future(), arrival,
                       deadline=own if deadline is not None else bound, shed_at=min(own, bound))

    def _expire(self, w: _Waiter) -> None:
        if w in self.queue and not w.future.done():
            self._count_shed()
            self._leave(w, ResourceExhausted(self._late_message(w)))

    def _leave(self, w: _Waiter, error: Exception, queued: bool = True) -> None:
        if queued and w in self.queue:
            self.queue.remove(w)
        if w.timer is not None:
            w.timer.cancel()
        if not w.future.done():
            w.future.set_exception(error)

    def _count_shed(self) -> None:
        self.shed += 1
        self.on_shed()

    def _late_message(self, w: _Waiter) -> str:
        waited = time.monotonic() - w.arrival
        if self.queue_timeout_s > 0 and w.shed_at == w.arrival + self.queue_timeout_s:
            why = f"it waited {waited:.1f} s, the router's bound (--queue-timeout-secs {self.queue_timeout_s:g})"
        else:
            why = f"its deadline passed after {waited:.1f} s"
        return (f"shed from the router queue ({self.inflight} requests in flight, --max-inflight "
                f"{self.max_inflight}): {why} before an in-flight slot was free; retry later")
