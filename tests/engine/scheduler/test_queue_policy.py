"""Torch-free tests of queue ordering, full-queue rejection and priority preemption."""

from __future__ import annotations

import dataclasses

import pytest

from tandem.engine.config import EngineConfig
from tandem.engine.errors import ResourceExhausted
from tandem.engine.outputs import FinishReason
from tandem.engine.sampling_params import SamplingParams
from tandem.engine.scheduler.batch import SampledToken
from tandem.engine.scheduler.queue_policy import PolicyQueue, QueuePolicy, check_priority
from tandem.engine.scheduler.request import Request, RequestStatus
from tandem.engine.scheduler.scheduler import Scheduler


@dataclasses.dataclass(eq=False)
class Item:
    name: str
    priority: int
    arrival: float


PRIO = QueuePolicy(enable_priority=True, preemption_threshold=10)


def names(q) -> list[str]:
    return [x.name for x in q]


def test_fifo_ignores_priority_and_appendleft_goes_first():
    q = PolicyQueue(QueuePolicy(), [Item("a", 0, 1), Item("b", 99, 2)])
    q.appendleft(Item("r", -5, 0.5))
    q.append(Item("c", 5, 3))
    assert names(q) == ["r", "a", "b", "c"]


def test_priority_order_then_arrival_and_flipped():
    items = [Item("lo", 0, 1), Item("hi", 5, 2), Item("lo2", 0, 0.5), Item("hi2", 5, 3)]
    assert names(PolicyQueue(PRIO, items)) == ["hi", "hi2", "lo2", "lo"]
    flipped = dataclasses.replace(PRIO, low_values_first=True)
    assert names(PolicyQueue(flipped, items)) == ["lo2", "lo", "hi", "hi2"]
    # A retracted request goes back by its priority and original arrival, not blindly to the front.
    q = PolicyQueue(PRIO, items)
    q.appendleft(Item("old-lo", 0, 0.1))
    assert names(q) == ["hi", "hi2", "old-lo", "lo2", "lo"]


def test_offer_turns_away_the_one_served_last():
    q = PolicyQueue(PRIO, [Item("a", 1, 1), Item("b", 3, 2)])
    assert q.offer(Item("c", 1, 3), capacity=2).name == "c"          # ties with a, newer: c goes
    assert names(q) == ["b", "a"]
    out = q.offer(Item("d", 2, 4), capacity=2)
    assert out.name == "a" and names(q) == ["b", "d"]                 # a is the lowest
    assert q.offer(Item("e", 9, 5), capacity=2, evictable=lambda x: False).name == "e"  # nothing evictable
    fifo = PolicyQueue(QueuePolicy(), [Item("a", 1, 1)])
    assert fifo.offer(Item("z", 100, 0), capacity=1).name == "z"      # FIFO: always the newcomer
    assert names(fifo) == ["a"]


def test_preemption_victim_needs_more_than_the_threshold():
    running = [Item("r0", 0, 1), Item("r5", 5, 2), Item("r0b", 0, 3)]
    progress = {"r0": 10, "r5": 0, "r0b": 3}.__getitem__
    assert PRIO.preemption_victim(Item("w", 10, 9), running, lambda r: progress(r.name)) is None  # 10 - 0 = threshold
    assert PRIO.preemption_victim(Item("w", 11, 9), running, lambda r: progress(r.name)).name == "r0b"  # least progress
    assert QueuePolicy().preemption_victim(Item("w", 1000, 9), running, lambda r: 0) is None


@pytest.mark.parametrize("bad", [True, 1.5, "3", 1 << 31, -(1 << 31) - 1])
def test_check_priority_rejects_non_int32(bad):
    with pytest.raises(ValueError, match="priority"):
        check_priority(bad)
    assert check_priority((1 << 31) - 1) == (1 << 31) - 1


# --- the scheduler with the policy -------------------------------------------------------------

CFG = EngineConfig(page_size=4, chunked_prefill_size=64, max_running_requests=2, max_queued_requests=3,
                   enable_priority_scheduling=True, priority_preemption_threshold=10)


def make(num_pages=64, **kw) -> Scheduler:
    return Scheduler(dataclasses.replace(CFG, **kw), num_pages, 256)


def req(rid: str, priority: int = 0, n: int = 5, max_tokens: int = 8) -> Request:
    return Request(rid, list(range(1, n + 1)), SamplingParams(max_tokens=max_tokens, temperature=0),
                   priority=priority)


def step(s: Scheduler):
    b = s.schedule()
    assert b is not None
    done = s.on_step_done(b, [SampledToken(7) for _ in b.sampling])
    for r, _ in done:
        if len(r.output_ids) >= r.params.max_tokens:
            s.finish(r, FinishReason.LENGTH)
    return b


def test_scheduler_admits_by_priority():
    s = make(max_running_requests=1)
    for rid, p in (("a", 0), ("b", 5), ("c", 1)):
        s.add(req(rid, p, max_tokens=1))
    order = []
    while s.has_work():
        order += [q.req.rid for q in step(s).seqs]
    assert order == ["b", "c", "a"]


def test_full_queue_evicts_the_lowest_priority_and_it_holds_nothing():
    s = make()
    low, mid, mid2 = req("low", 0), req("mid", 3), req("mid2", 3)
    for r in (low, mid, mid2):
        s.add(r)
    with pytest.raises(ResourceExhausted, match="full.*lower priority than this one \\(0\\)"):
        s.add(req("late-low", 0))
    s.add(req("high", 9))
    [(evicted, err)] = s.take_evicted()
    assert evicted is low and low.status is RequestStatus.FINISHED and low.finish_reason is FinishReason.ABORT
    assert "higher priority (9)" in str(err) and "(0)" in str(err)
    assert [r.rid for r in s.waiting] == ["high", "mid", "mid2"]
    assert s.take_evicted() == []
    while s.has_work():
        step(s)
    s.check_idle()


def test_high_priority_preempts_a_running_low_one_which_is_recomputed():
    s = make(max_running_requests=2)
    lo1, lo2 = req("lo1", 0, max_tokens=6), req("lo2", 5, max_tokens=6)
    s.add(lo1)
    s.add(lo2)
    step(s)                                   # both prefilled, both running
    step(s)                                   # one decode step
    assert set(s.running) == {lo1, lo2}
    hi = req("hi", 20, max_tokens=2)
    s.add(hi)
    b = s.schedule()                          # no free slot: lo1 (least urgent) makes room
    # hi's prefill runs in this step (beside lo2's decode row: mixed chunks); lo1 is out.
    assert [q.req for q in b.seqs] == [hi, lo2]
    assert lo1.status is RequestStatus.WAITING and lo1.slot is None and s.num_preemptions == 1
    assert lo2 in s.running
    s.on_step_done(b, [SampledToken(7) for _ in b.sampling])
    while s.has_work():
        step(s)
    assert len(lo1.output_ids) == 6 and lo1.num_retractions == 1   # recomputed, finished
    s.check_idle()


def test_no_preemption_within_the_threshold_or_when_disabled():
    for kw in ({}, {"enable_priority_scheduling": False}):
        s = make(max_running_requests=1, **kw)
        lo = req("lo", 0, max_tokens=4)
        s.add(lo)
        step(s)
        s.add(req("hi", 10 if not kw else 1000))
        b = s.schedule()
        assert [q.req for q in b.seqs] == [lo] and s.num_preemptions == 0
