"""Torch-free: the scheduler commits a step when it schedules it, so the next step can be planned
before the tokens arrive (overlap scheduling)."""

from __future__ import annotations

from tandem.engine.outputs import FinishReason
from tandem.engine.scheduler.batch import SampledToken
from tandem.engine.scheduler.future import FutureSlots, future_ref
from tests.engine.scheduler.test_scheduler import make, req


def tokens(batch, tok=7):
    return [SampledToken(tok) for _ in batch.sampling]


def test_next_step_refers_to_tokens_still_being_sampled():
    s = make()
    a = req("a", 5, max_tokens=4)
    s.add(a)
    b1 = s.schedule()                       # prefill; a joins the running batch at once
    assert a in s.running and a.num_computed == 5 and a.num_inflight == 1
    b2 = s.schedule()                       # planned before b1's token is known
    (seq,) = b2.seqs
    assert seq.input_ids == [future_ref(b1.seqs[0].future)] and seq.prefix_len == 5 and b2.has_future_inputs
    assert seq.future != b1.seqs[0].future and a.num_inflight == 2
    assert [r.rid for r, _ in s.on_step_done(b1, tokens(b1, 11))] == ["a"]
    assert a.output_ids == [11] and a.num_inflight == 1
    b3 = s.schedule()                       # b2 in flight: b3 refers to b2's slot
    assert b3.seqs[0].input_ids == [future_ref(b2.seqs[0].future)] and b3.seqs[0].prefix_len == 6
    s.on_step_done(b2, tokens(b2, 12))
    # two tokens out, the third in flight with b3: one more may be scheduled
    assert a.remaining_tokens == 4 - 2 - 1
    s.on_step_done(b3, tokens(b3, 13))
    assert a.output_ids == [11, 12, 13] and a.num_inflight == 0
    s.finish(a, FinishReason.LENGTH)
    s.check_idle()


def test_request_whose_last_token_is_in_flight_sits_out():
    s = make()
    a, b = req("a", 4, max_tokens=1), req("b", 4, max_tokens=5)
    s.add(a)
    s.add(b)
    b1 = s.schedule()
    b2 = s.schedule()
    assert [x.req.rid for x in b2.seqs] == ["b"]   # a's only token is in b1: nothing left to run
    s.on_step_done(b1, tokens(b1))
    s.finish(a, FinishReason.LENGTH)
    s.on_step_done(b2, tokens(b2))
    s.finish(b, FinishReason.ABORT)
    s.check_idle()


def test_finished_while_in_the_next_step_gets_no_token():
    s = make()
    a = req("a", 4, max_tokens=8)
    s.add(a)
    b1 = s.schedule()
    b2 = s.schedule()
    s.on_step_done(b1, tokens(b1))
    s.finish(a, FinishReason.STOP)          # a stop seen in b1's token; b2 already carries a
    assert s.on_step_done(b2, tokens(b2)) == [] and a.output_ids == [7]
    s.check_idle()


def test_retracted_with_a_token_in_flight_waits_for_it():
    s = make(num_pages=4, init_new_token_ratio=0.0, min_new_token_ratio=0.0)  # 16 tokens
    a, b = req("a", 8, max_tokens=8), req("b", 8, max_tokens=8)
    s.add(a)
    s.add(b)
    b1 = s.schedule()
    assert {x.req.rid for x in b1.seqs} == {"a", "b"}      # 2 pages each: the pool is full
    b2 = s.schedule()                       # both need a 3rd page at position 8: one is retracted
    assert s.num_retractions == 1
    victim = b if b in s.waiting else a
    assert victim.num_inflight == 1 and victim.slot is None
    assert all(x.req is not victim for x in b2.seqs)      # ... and is not re-admitted before its token lands
    s.on_step_done(b1, tokens(b1))
    assert victim.output_ids == [7] and victim.num_inflight == 0
    s.on_step_done(b2, tokens(b2))
    for r in (a, b):
        s.finish(r, FinishReason.ABORT)
    s.check_idle()


def test_future_slots_cover_two_steps():
    f = FutureSlots(3)
    taken = [f.take() for _ in range(f.size)]
    assert sorted(taken) == list(range(f.size)) and f.size >= 2 * 3 and f.take() == taken[0]
