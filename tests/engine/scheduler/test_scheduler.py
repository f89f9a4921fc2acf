"""Torch-free tests of the co-located scheduler's bookkeeping (no model: tokens are made up)."""

from __future__ import annotations

import dataclasses

import pytest

from tandem.engine.config import EngineConfig
from tandem.engine.errors import InvalidRequest, ResourceExhausted
from tandem.engine.outputs import FinishReason
from tandem.engine.sampling_params import SamplingParams
from tandem.engine.scheduler.batch import SampledToken
from tandem.engine.scheduler.request import Request, RequestStatus
from tandem.engine.scheduler.scheduler import Scheduler

CFG = EngineConfig(page_size=4, chunked_prefill_size=16, max_running_requests=8, max_queued_requests=4)


def make(num_pages=32, context=256, **kw) -> Scheduler:
    return Scheduler(dataclasses.replace(CFG, **kw), num_pages, context)


def req(rid: str, n: int, max_tokens: int = 8) -> Request:
    return Request(rid, list(range(1, n + 1)), SamplingParams(max_tokens=max_tokens, temperature=0))


def run_to_end(s: Scheduler, max_steps: int = 1000) -> list:
    """Drive the scheduler with token 7 every step; finish at max_tokens. Returns the batches."""
    batches = []
    for _ in range(max_steps):
        if not s.has_work():
            return batches
        b = s.schedule()
        assert b is not None
        batches.append(b)
        for r, _tok in s.on_step_done(b, [SampledToken(7) for _ in b.sampling]):
            if len(r.output_ids) >= r.params.max_tokens:
                s.finish(r, FinishReason.LENGTH)
    raise AssertionError("scheduler did not finish")


def test_rejects_requests_that_can_never_run():
    s = make(num_pages=8, context=64)
    with pytest.raises(InvalidRequest, match="empty"):
        s.add(req("a", 0))
    with pytest.raises(InvalidRequest) as e:
        s.add(req("b", 64))
    assert e.value.param == "prompt"
    with pytest.raises(InvalidRequest) as e:
        s.add(req("c", 60, max_tokens=10))
    assert e.value.param == "max_tokens"
    with pytest.raises(InvalidRequest, match="KV cache capacity"):
        s.add(req("d", 30, max_tokens=10))  # 40 tokens > 8 pages * 4
    assert not s.has_work()


def test_bounded_waiting_queue():
    s = make()
    for i in range(4):
        s.add(req(f"r{i}", 5))
    with pytest.raises(ResourceExhausted):
        s.add(req("overflow", 5))
    assert len(s.waiting) == 4


def test_chunked_prefill_respects_token_budget_and_samples_on_last_chunk():
    s = make()
    r = req("long", 40)
    s.add(r)
    chunks = []
    while r.status is not RequestStatus.RUNNING:
        b = s.schedule()
        assert b.num_tokens <= 16
        chunks.append((b.seqs[0].prefix_len, len(b.seqs[0].input_ids), b.seqs[0].sample))
        s.on_step_done(b, [SampledToken(7) for _ in b.sampling])
    assert chunks == [(0, 16, False), (16, 16, False), (32, 8, True)]
    assert r.output_ids == [7]


def test_prefill_batches_several_prompts_then_decodes_them_together():
    s = make()
    for i, n in enumerate([3, 5, 6]):
        s.add(req(f"r{i}", n, max_tokens=3))
    first = s.schedule()
    assert [len(x.input_ids) for x in first.seqs] == [3, 5, 6] and all(x.sample for x in first.seqs)
    s.on_step_done(first, [SampledToken(7)] * 3)
    second = s.schedule()
    assert second.is_decode and len(second.seqs) == 3
    assert [x.prefix_len for x in second.seqs] == [3, 5, 6]


def test_all_pages_and_slots_return_after_run():
    s = make()
    for i in range(4):
        s.add(req(f"r{i}", 5 + 3 * i, max_tokens=6))
    run_to_end(s)
    s.check_idle()


def test_prefix_cache_serves_shared_pages():
    s = make()
    a = req("a", 13, max_tokens=2)
    s.add(a)
    run_to_end(s)
    b = req("b", 13, max_tokens=2)
    s.add(b)
    batch = s.schedule()
    assert b.cache_len == 12 and batch.seqs[0].prefix_len == 12 and batch.seqs[0].input_ids == [13]
    s.on_step_done(batch, [SampledToken(7)])
    run_to_end(s)
    s.check_idle()


def test_retraction_when_decode_runs_out_of_pages():
    # 10 pages of 4 tokens; 3 requests of 8 prompt + 12 output tokens need 15 pages in the end.
    s = make(num_pages=10, init_new_token_ratio=0.0, min_new_token_ratio=0.0)
    reqs = [req(f"r{i}", 8, max_tokens=12) for i in range(3)]
    for r in reqs:
        s.add(r)
    run_to_end(s)
    assert s.num_retractions > 0
    assert all(len(r.output_ids) == 12 for r in reqs)
    assert any(r.num_retractions for r in reqs)
    s.check_idle()


def test_admission_reserves_pages_for_running_requests():
    # With ratio 1.0 the first request reserves all its future pages: the second must wait.
    s = make(num_pages=8, init_new_token_ratio=1.0, min_new_token_ratio=1.0)
    s.add(req("a", 4, max_tokens=20))
    s.add(req("b", 4, max_tokens=20))
    b = s.schedule()
    assert [x.req.rid for x in b.seqs] == ["a"]
    s.on_step_done(b, [SampledToken(7)])
    run_to_end(s)
    assert s.num_retractions == 0
    s.check_idle()


def test_finish_mid_prefill_frees_everything():
    s = make()
    r = req("x", 40)
    s.add(r)
    b = s.schedule()
    s.on_step_done(b, [])
    s.finish(r, FinishReason.ABORT)
    assert r.finished and r.slot is None
    s.check_idle()


def test_finish_while_waiting():
    s = make()
    r = req("w", 5)
    s.add(r)
    s.finish(r, FinishReason.ABORT)
    assert not s.has_work()
    s.check_idle()
