"""Mixed chunks: prefill chunks ride in the same step as the running requests' decode tokens (torch-free)."""

from __future__ import annotations

import dataclasses

from tandem.engine.config import EngineConfig
from tandem.engine.outputs import FinishReason
from tandem.engine.sampling_params import SamplingParams
from tandem.engine.scheduler.batch import SampledToken, StepBatch
from tandem.engine.scheduler.request import Request, RequestStatus
from tandem.engine.scheduler.scheduler import Scheduler
from tandem.engine.scheduler.step_cost import StepCostModel

CFG = EngineConfig(page_size=4, chunked_prefill_size=16, max_running_requests=8, mixed_chunk_itl_factor=0)


def make(num_pages=64, clock=None, **kw) -> Scheduler:
    cfg = dataclasses.replace(CFG, **kw)
    return Scheduler(cfg, num_pages, 256) if clock is None else Scheduler(cfg, num_pages, 256, clock=clock)


def req(rid: str, n: int, max_tokens: int = 4) -> Request:
    return Request(rid, list(range(1, n + 1)), SamplingParams(max_tokens=max_tokens, temperature=0))


def finish_step(s: Scheduler, b: StepBatch) -> None:
    for r, _ in s.on_step_done(b, [SampledToken(7) for _ in b.sampling]):
        if len(r.output_ids) >= r.params.max_tokens:
            s.finish(r, FinishReason.LENGTH)


def decode_rows(b: StepBatch) -> list[Request]:
    return [q.req for q in b.seqs if q.req.status is RequestStatus.RUNNING]


def test_a_new_prompt_joins_the_running_decodes_and_the_budget_counts_them():
    s = make()
    running = [req(f"r{i}", 3, max_tokens=10) for i in range(3)]
    for r in running:
        s.add(r)
    finish_step(s, s.schedule())                     # one prefill step: all three now decode
    s.add(req("long", 40))
    b = s.schedule()
    assert set(decode_rows(b)) == set(running)       # nobody stalls behind the new prompt
    chunk = [q for q in b.seqs if q.req.rid == "long"]
    assert len(chunk[0].input_ids) == 16 - 3         # chunked_prefill_size counts the decode rows
    assert b.num_tokens == 16
    finish_step(s, b)


def test_disabled_alternates_prefill_and_decode_steps():
    s = make(enable_mixed_chunk=False)
    s.add(req("a", 3, max_tokens=10))
    finish_step(s, s.schedule())
    s.add(req("b", 40))
    b = s.schedule()
    assert [q.req.rid for q in b.seqs] == ["b"] and not decode_rows(b)


def test_run_to_end_with_arrivals_returns_every_page_and_slot():
    s = make(num_pages=24)   # tight: decode rows must secure their pages before a prompt is admitted
    pending = [req(f"q{i}", 5 + 7 * i, max_tokens=6) for i in range(6)]
    s.add(pending.pop(0))
    mixed = 0
    for _ in range(500):
        if pending and len(s.running) < 3:
            s.add(pending.pop(0))
        if not s.has_work() and not pending:
            break
        b = s.schedule()
        if b is None:
            continue
        mixed += bool(decode_rows(b)) and len(decode_rows(b)) < len(b.seqs)
        assert b.num_tokens <= 16
        finish_step(s, b)
    assert not pending and not s.has_work() and mixed > 0
    s.check_idle()


def test_cost_model_bounds_the_chunk_by_measured_step_times():
    # Steps cost 10 ms + 2.5 ms per decode row + 1 ms per prefill token.
    def t(rows, tokens):
        return 0.010 + 0.0025 * rows + 0.001 * tokens

    cost = StepCostModel()
    assert cost.prefill_budget(1.8, 8, 16, 2000) == 2000          # nothing measured yet
    for rows, tokens in [(8, 0), (8, 100), (4, 0), (0, 256), (12, 40), (8, 0), (6, 20)]:
        cost.observe(tokens, rows, t(rows, tokens))
    assert abs(cost.decode_step_s(8) - 0.030) < 1e-4
    assert cost.prefill_budget(1.8, 8, 16, 2000) == 24             # 0.8 x 30 ms / 1 ms
    assert cost.prefill_budget(1.8, 16, 16, 2000) == 40            # a bigger batch: a longer step
    assert cost.prefill_budget(1.1, 8, 16, 2000) == 16             # never below the floor
    assert cost.prefill_budget(0, 8, 16, 2000) == 2000             # 0: unbounded


def test_cost_model_follows_a_batch_that_only_runs_mixed_steps():
    # Under load nearly every step is mixed: the decode part must still be learned from them.
    cost = StepCostModel()
    cost.observe(0, 2, 0.015)
    for rows in range(2, 30):
        cost.observe(20, rows, 0.010 + 0.0025 * rows + 0.020)
    assert abs(cost.decode_step_s(29) - (0.010 + 0.0025 * 29)) < 2e-3


def test_scheduler_learns_costs_from_its_own_steps():
    s = make(mixed_chunk_itl_factor=1.5)
    s.add(req("a", 3, max_tokens=50))
    for _ in range(3):
        finish_step(s, s.schedule())
    assert s.cost.steps == 3                                    # the scheduler timed its own steps
    s.cost = StepCostModel()
    s.cost.observe(10, 1, 0.020)
    for _ in range(20):                                         # pin the fit: 10 ms decode + 1 ms/token
        s.cost.observe(0, 1, 0.010)
        s.cost.observe(10, 1, 0.020)
    s.add(req("long", 60))
    b = s.schedule()
    assert [len(q.input_ids) for q in b.seqs if q.req.rid == "long"] == [5]   # 0.5 x 10 ms / 1 ms


def pinned(s: Scheduler) -> None:
    """Pin the cost fit: a decode step is 10 ms, a prefill token costs 1 ms."""
    s.cost = StepCostModel()
    s.cost.observe(10, 1, 0.020)
    for _ in range(20):
        s.cost.observe(0, 1, 0.010)
        s.cost.observe(10, 1, 0.020)


def test_ttft_target_grows_the_chunk_when_the_queue_would_miss_it():
    now = [1000.0]
    s = make(clock=lambda: now[0], mixed_chunk_itl_factor=1.5, mixed_chunk_ttft_target_s=0.2, chunked_prefill_size=64)
    s.add(req("a", 3, max_tokens=50))
    finish_step(s, s.schedule())
    pinned(s)
    young = req("young", 60)
    young.arrival = now[0]
    s.add(young)
    b = s.schedule()        # 200 ms left - 60 ms of work = 140 ms spare: 14 steps of 10 ms, 5 tokens each
    assert [len(q.input_ids) for q in b.seqs if q.req.rid == "young"] == [5]   # the ITL bound (5) holds
    finish_step(s, b)
    now[0] += 0.05          # 150 ms left, 55 tokens (55 ms) to go: 95 ms spare, 9.5 steps -> 6 tokens
    pinned(s)               # (the step just timed itself into the fit)
    b = s.schedule()
    (k,) = [len(q.input_ids) for q in b.seqs if q.req.rid == "young"]
    assert 5 <= k <= 7      # (the ridge-regularised fit is within a few % of the pinned costs)
    finish_step(s, b)
    now[0] += 0.2           # young is past the target: it is finished in this step, as it would be
    burst = req("burst", 100)   # without mixed chunks; a prompt arriving now keeps its own deadline
    burst.arrival = now[0]
    s.add(burst)
    pinned(s)
    b = s.schedule()
    assert {q.req.rid: len(q.input_ids) for q in b.seqs if q.req.rid != "a"} == {"young": 60 - 5 - k}
    finish_step(s, b)
    pinned(s)
    b = s.schedule()        # 100 tokens (100 ms) by its deadline 200 ms away: 100 ms for the decode
    (k,) = [len(q.input_ids) for q in b.seqs if q.req.rid == "burst"]   # parts, 10-15 ms each (one or
    assert 10 <= k <= 16    # two rows in the fit): 10-15 tokens a step, not one stalling step of 100


def test_ttft_target_off_keeps_the_itl_bound():
    s = make(clock=lambda: 5000.0, mixed_chunk_itl_factor=1.5, mixed_chunk_ttft_target_s=0)
    s.add(req("a", 3, max_tokens=50))
    finish_step(s, s.schedule())
    pinned(s)
    old = req("old", 60)
    old.arrival = 0.0       # waited ages
    s.add(old)
    b = s.schedule()
    assert [len(q.input_ids) for q in b.seqs if q.req.rid == "old"] == [5]
