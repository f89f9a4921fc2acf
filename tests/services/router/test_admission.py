"""The router's admission queue: slots, priority order, full-queue rejection, cancelled waiters."""

from __future__ import annotations

import asyncio
import random
import time

import pytest

from tandem.engine.errors import ResourceExhausted
from tandem.engine.scheduler.queue_policy import QueuePolicy
from tandem.services.router.admission import Admission

PRIO = QueuePolicy(enable_priority=True)


def test_without_a_queue_beyond_max_inflight_is_refused():
    async def body():
        a = Admission(1, 0, QueuePolicy())
        await a.acquire()
        with pytest.raises(ResourceExhausted, match="--max-inflight 1"):
            await a.acquire()
        a.release()
        assert a.inflight == 0

    asyncio.run(body())


def test_waiters_get_slots_by_priority_and_the_lowest_is_turned_away():
    async def body():
        a = Admission(1, 2, PRIO)
        await a.acquire()
        order = []

        async def wait(name, prio):
            await a.acquire(prio)
            order.append(name)

        low = asyncio.create_task(wait("low", 0))
        mid = asyncio.create_task(wait("mid", 5))
        await asyncio.sleep(0)
        with pytest.raises(ResourceExhausted, match="router queue is full"):
            await a.acquire(0)                      # ties with low, newer: the newcomer goes
        high = asyncio.create_task(wait("high", 9))
        await asyncio.sleep(0)
        with pytest.raises(ResourceExhausted, match="higher priority \\(9\\)"):
            await low                               # pushed out by high
        a.release()
        await asyncio.sleep(0)
        a.release()
        await asyncio.gather(mid, high)
        assert order == ["high", "mid"] and a.inflight == 1
        a.release()
        assert a.inflight == 0 and not a.queue

    asyncio.run(body())


def test_a_cancelled_or_timed_out_waiter_leaves_no_slot_behind():
    async def body():
        a = Admission(1, 4, QueuePolicy())
        await a.acquire()
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(a.acquire(), 0.01)
        assert not a.queue
        a.release()
        assert a.inflight == 0

    asyncio.run(body())


# ---- deadlines: order and shedding ---------------------------------------------------------------

def _waiting(a: Admission, order: list, name: str, prio: int = 0, deadline: float | None = None):
    async def wait():
        await a.acquire(prio, deadline)
        order.append(name)
    return asyncio.create_task(wait())


def test_equal_priorities_are_served_earliest_deadline_first_then_arrival():
    async def body():
        a = Admission(1, 8, QueuePolicy())
        await a.acquire()
        now, order = time.monotonic(), []
        tasks = [_waiting(a, order, "none"), _waiting(a, order, "late", deadline=now + 50),
                 _waiting(a, order, "soon", deadline=now + 5), _waiting(a, order, "soon2", deadline=now + 5)]
        await asyncio.sleep(0)
        for _ in tasks:
            a.release()
            await asyncio.sleep(0)
        await asyncio.gather(*tasks)
        assert order == ["soon", "soon2", "late", "none"]   # no deadline: arrival + 60 s (--queue-timeout-secs)
        a.release()
        assert a.inflight == 0 and not a.queue

    asyncio.run(body())


def test_priority_comes_before_deadline_and_a_full_queue_sheds_the_lowest_latest():
    async def body():
        a = Admission(1, 2, PRIO)
        await a.acquire()
        now, order = time.monotonic(), []
        urgent_late = _waiting(a, order, "urgent_late", 5, now + 50)
        low_late = _waiting(a, order, "low_late", 0, now + 50)
        await asyncio.sleep(0)
        low_soon = _waiting(a, order, "low_soon", 0, now + 5)     # same priority, earlier deadline: low_late goes
        await asyncio.sleep(0)
        with pytest.raises(ResourceExhausted, match="turned away"):
            await low_late
        a.release()
        await asyncio.sleep(0)
        a.release()
        await asyncio.gather(urgent_late, low_soon)
        assert order == ["urgent_late", "low_soon"]
        a.release()
        assert a.inflight == 0 and not a.queue

    asyncio.run(body())


def test_a_waiter_is_shed_with_resource_exhausted_as_soon_as_its_deadline_passes():
    async def body():
        a = Admission(1, 4, QueuePolicy())
        await a.acquire()
        t0 = time.monotonic()
        keeps = asyncio.create_task(a.acquire(0, t0 + 30))
        with pytest.raises(ResourceExhausted, match="deadline passed"):
            await a.acquire(0, t0 + 0.05)
        assert time.monotonic() - t0 < 1.0 and a.shed == 1 and len(a.queue) == 1
        with pytest.raises(ResourceExhausted, match="deadline passed"):
            await a.acquire(0, t0 - 1)                              # already late: shed without queueing
        a.release()
        await keeps                                                 # the slot went to the one still in time
        a.release()
        assert a.inflight == 0 and not a.queue

    asyncio.run(body())


def test_the_queue_timeout_bounds_the_wait_of_a_request_without_a_deadline():
    async def body():
        a = Admission(1, 4, QueuePolicy(), queue_timeout_s=0.05)
        await a.acquire()
        with pytest.raises(ResourceExhausted, match="--queue-timeout-secs 0.05"):
            await a.acquire()
        a.release()
        assert a.inflight == 0 and not a.queue and a.shed == 1

    asyncio.run(body())


def test_release_never_hands_a_slot_to_a_waiter_whose_time_is_up():
    async def body():
        a = Admission(1, 4, QueuePolicy())
        await a.acquire()
        late = asyncio.create_task(a.acquire(0, time.monotonic() + 0.02))
        in_time = asyncio.create_task(a.acquire(0, time.monotonic() + 30))
        await asyncio.sleep(0)
        time.sleep(0.03)             # the loop is busy: `late`'s timer cannot run before release()
        a.release()
        with pytest.raises(ResourceExhausted, match="deadline passed"):
            await late
        await in_time
        assert a.inflight == 1
        a.release()
        assert a.inflight == 0 and not a.queue

    asyncio.run(body())


def test_every_acquire_is_paired_with_one_release_under_churn():
    """Random arrivals, deadlines, priorities, cancellations and sheds: at the end no slot, waiter or
    timer is left, and in-flight never exceeded the bound."""
    async def body():
        rng = random.Random(7)
        a = Admission(3, 5, PRIO, queue_timeout_s=0.2)
        peak = 0
        outcomes: list[str] = []

        async def client(i: int):
            nonlocal peak
            deadline = time.monotonic() + rng.choice([0.01, 0.05, 1.0]) if rng.random() < 0.5 else None
            try:
                await a.acquire(rng.randint(0, 3), deadline)
            except ResourceExhausted:
                outcomes.append("shed")
                return
            try:
                peak = max(peak, a.inflight)
                await asyncio.sleep(rng.uniform(0, 0.03))
                outcomes.append("ok")
            finally:
                a.release()

        tasks = []
        for i in range(200):
            tasks.append(asyncio.create_task(client(i)))
            if rng.random() < 0.3:
                await asyncio.sleep(0.002)
            if rng.random() < 0.1:
                rng.choice(tasks).cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        assert a.inflight == 0 and not a.queue and peak <= 3
        assert "ok" in outcomes and "shed" in outcomes
        timers = [h for h in asyncio.get_running_loop()._scheduled if not h.cancelled()]
        assert not [h for h in timers if getattr(h._callback, "__func__", None) is Admission._expire]

    asyncio.run(body())
