"""Torch-free tests of who gets a step's prefill budget (engine/scheduler/prefill_order.py)."""

from __future__ import annotations

import dataclasses
import time

from tandem.engine.config import EngineConfig
from tandem.engine.sampling_params import SamplingParams
from tandem.engine.scheduler.batch import SampledToken
from tandem.engine.scheduler.prefill_order import PrefillOrder
from tandem.engine.scheduler.queue_policy import QueuePolicy
from tandem.engine.scheduler.request import Request, RequestStatus
from tandem.engine.scheduler.scheduler import Scheduler

CFG = EngineConfig(page_size=4, chunked_prefill_size=16, max_running_requests=8, enable_mixed_chunk=False)


def req(rid: str, n: int, arrival: float, priority: int = 0) -> Request:
    return Request(rid, list(range(1, n + 1)), SamplingParams(max_tokens=4, temperature=0), arrival=arrival,
                   priority=priority)


def step(s: Scheduler) -> list[tuple[str, int]]:
    b = s.schedule()
    s.on_step_done(b, [SampledToken(7) for _ in b.sampling])
    return [(q.req.rid, len(q.input_ids)) for q in b.seqs]


def test_short_prompt_is_not_stuck_behind_a_long_ones_chunks():
    for policy in ("shortest-first", "fcfs"):
        s = Scheduler(dataclasses.replace(CFG, prefill_schedule_policy=policy, prefill_max_wait_s=60), 64, 256)
        now = time.monotonic()
        s.add(req("long", 64, arrival=now))
        assert step(s) == [("long", 16)]
        s.add(req("short", 5, arrival=now + 0.1))
        second = step(s)
        if policy == "fcfs":  # the long prompt's chunk takes the whole budget; short waits 3 more steps
            assert second == [("long", 16)]
        else:  # the short prompt goes first and completes; the long one gets what is left
            assert second == [("short", 5), ("long", 11)]
            assert not s.waiting and [r.rid for r in s.running] == ["short"]


def test_age_bounds_starvation_of_a_long_prompt():
    order = PrefillOrder("shortest-first", max_wait_s=2.0)
    q = QueuePolicy()
    long, short = req("long", 500, arrival=0.0), req("short", 5, arrival=0.5)
    assert [r.rid for r in order.order([], [long, short], q, now=1.0)] == ["short", "long"]
    # At now=2.5 the long prompt waited past the bound: it goes first, and the oldest overdue first.
    older = req("older", 900, arrival=-1.0)
    assert [r.rid for r in order.order([], [long, short, older], q, now=2.5)] == ["older", "long", "short"]


def test_shortest_first_counts_work_left_and_keeps_priorities_first():
    order = PrefillOrder("shortest-first", max_wait_s=100.0)
    started = req("started", 100, arrival=0.0)
    started.status, started.fill_len, started.num_computed = RequestStatus.PREFILLING, 100, 96
    fresh = req("fresh", 10, arrival=1.0)
    urgent = req("urgent", 50, arrival=2.0, priority=5)
    assert [r.rid for r in order.order([started], [fresh, urgent], QueuePolicy(), now=3.0)] == \
        ["started", "fresh", "urgent"]  # 4 tokens left < 10 < 50
    assert [r.rid for r in order.order([started], [fresh, urgent], QueuePolicy(enable_priority=True), now=3.0)] == \
        ["urgent", "started", "fresh"]


def test_fcfs_keeps_the_old_order():
    order = PrefillOrder("fcfs")
    a, b, c = req("a", 50, 0.0), req("b", 5, 1.0), req("c", 1, 2.0)
    assert order.order([a], [b, c], QueuePolicy(), now=100.0) == [a, b, c]


def test_a_waiting_prompt_that_does_not_fit_stops_admission_but_not_started_chunks():
    # 10 pages of 4 tokens: "long" (32 tokens, 8 pages) is prefilling; "mid" (9 tokens, 3 pages) comes
    # first by size but does not fit, and "big" behind it is not admitted past it; "long" still computes.
    s = Scheduler(dataclasses.replace(CFG, prefill_max_wait_s=60, init_new_token_ratio=0.0,
                                      min_new_token_ratio=0.0), 10, 256)
    now = time.monotonic()
    s.add(req("long", 32, arrival=now))
    assert step(s) == [("long", 16)]
    s.add(req("big", 12, arrival=now))
    s.add(req("mid", 9, arrival=now))
    assert step(s) == [("long", 16)]
    assert [r.rid for r in s.waiting] == ["big", "mid"]
    assert [r.rid for r in s.running] == ["long"]
