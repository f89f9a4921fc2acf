"""The scheduler's hand-offs to the roles (stats, prefill queue, reserve/release, new_queue): what the
prefill, decode and co-located workers read and change instead of reaching into its queues."""

from __future__ import annotations

from tandem.engine.scheduler.batch import SampledToken
from tandem.engine.scheduler.stats import SchedulerStats
from tests.engine.scheduler.test_scheduler import make, req


def test_stats_count_queues_tokens_pages_and_slots():
    s = make(num_pages=32)   # page_size 4, chunk 16, 8 slots
    assert s.stats() == SchedulerStats(waiting=0, prefilling=0, running=0, prefill_tokens=0,
                                       free_pages=32, total_pages=32, free_slots=8)
    for r in (req("a", 24), req("b", 3), req("c", 5)):
        s.add(r)
    s.schedule()   # 16 tokens: b (3) and c (5) admitted whole, a admitted and 8 of its 24 computed
    stats = s.stats()
    assert (stats.waiting, stats.prefilling, stats.running) == (0, 1, 2)
    assert stats.prefill_tokens == 16
    assert stats.free_pages == 32 - 6 - 1 - 2 and stats.free_slots == 5


def test_prefill_queue_orders_like_the_budget_and_counts_tokens_left():
    s = make(num_pages=32)
    long, short = req("long", 40), req("short", 6)
    s.add(long)
    s.schedule()                       # long: 16 of 40 computed
    s.add(short)
    order = s.prefill_queue(s.clock())
    assert [(r.rid, left) for r, left in order] == [("short", 6), ("long", 24)]   # shortest-first
    assert sum(left for _, left in order) == s.stats().prefill_tokens


def test_reserve_then_release_returns_every_page():
    s = make(num_pages=8)
    held = req("room", 12)
    assert s.reserve(held) and len(held.pages) == 3 and held.slot is not None
    assert s.stats().free_pages == 5 and not s.has_work()   # outside the queues
    too_big = req("big", 24)
    assert not s.reserve(too_big, pending=[held]) and too_big.slot is None   # all-or-nothing
    s.release(held)
    s.release(held)                    # safe twice
    s.check_idle()


def test_detached_request_keeps_pages_until_released_into_the_cache():
    s = make(num_pages=8)
    r = req("p", 8, max_tokens=1)
    s.add(r)
    batch = s.schedule()
    [(done, _)] = s.on_step_done(batch, [SampledToken(7)])
    s.detach(done)
    assert s.stats().running == 0 and s.stats().free_pages == 6
    s.release(done, done.prompt_ids)
    assert s.kv.cache.evictable_pages == 2   # the prompt's full pages are cached
    s.check_idle()


def test_new_queue_orders_like_the_waiting_queue():
    s = make(enable_priority_scheduling=True)
    q = s.new_queue()
    low, high = req("low", 4), req("high", 4)
    high.priority = 5
    q.offer(low, 4)
    q.offer(high, 4)
    assert [r.rid for r in q] == ["high", "low"] and q.policy == s.policy
