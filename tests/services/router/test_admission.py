"""The router's admission queue: slots, priority order, full-queue rejection, cancelled waiters."""

from __future__ import annotations

import asyncio

import pytest

from engine.errors import ResourceExhausted
from engine.scheduler.queue_policy import QueuePolicy
from services.router.admission import Admission

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
