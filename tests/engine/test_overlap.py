"""Overlap scheduling gives exactly what plain steps give: greedy tokens through arrivals, prefix
hits, chunked prefill, mixed chunks, retraction and aborts; stop conditions met while the next step
already runs; seeded sampling; penalties (which force a synchronous step). Every run ends idle."""

from __future__ import annotations

import pytest

from tandem.engine.sampling_params import SamplingParams
from tests.engine.test_engine_vs_hf import greedy, make_engine, random_prompts
from tests.engine.test_mixed_chunk_engine import run_staggered


def pair(path, **kw):
    return (make_engine(path, enable_overlap_schedule=False, **kw),
            make_engine(path, enable_overlap_schedule=True, **kw))


@pytest.mark.parametrize("mixed", [True, False], ids=["mixed", "plain"])
@pytest.mark.parametrize("pool_tokens", [2048, 64], ids=["roomy", "tight-retracts"])
def test_overlap_equals_plain(tiny_llama, mixed, pool_tokens):
    base = random_prompts([9, 30, 4, 21], 512, seed=11)
    prompts = base + [base[1][:24] + [7, 8, 9]]      # a prefix hit on prompt 1's pages
    kw = dict(chunked_prefill_size=8, max_total_tokens=pool_tokens, enable_mixed_chunk=mixed,
              mixed_chunk_itl_factor=0)
    if pool_tokens < 100:
        kw.update(init_new_token_ratio=0.01, min_new_token_ratio=0.01)
    plain, over = pair(tiny_llama, **kw)
    want, _ = run_staggered(plain, prompts, 10)
    got, _ = run_staggered(over, prompts, 10)
    assert got == want
    assert over.num_overlapped_steps > 0 and plain.num_overlapped_steps == 0
    if pool_tokens < 100:
        assert over.scheduler.num_retractions > 0
    over.close()


def test_abort_mid_batch(tiny_llama):
    prompts = random_prompts([12, 5, 17], 512, seed=12)
    plain, over = pair(tiny_llama, chunked_prefill_size=8)
    want, _ = run_staggered(plain, prompts, 8)
    got, _ = run_staggered(over, prompts, 8, abort_at=1)   # ends idle: check_idle inside
    assert got[0] == want[0] and got[2] == want[2]
    assert len(got.get(1, [])) < 8


def _finish_all(engine, prompts, params):
    rids = [engine.add_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
    outs = {rid: [] for rid in rids}
    while engine.has_work():
        for o in engine.step():
            outs[o.rid].append(o)
    engine.check_idle()
    return [([t for o in outs[r] for t in o.token_ids], outs[r][-1].finish_reason, outs[r][-1].usage)
            for r in rids]


def test_stop_conditions_met_while_the_next_step_runs(tiny_llama):
    prompts = random_prompts([7, 15, 10, 3], 512, seed=5)
    plain, over = pair(tiny_llama)
    free = _finish_all(plain, prompts, [greedy(12)] * 4)
    assert _finish_all(over, prompts, [greedy(12)] * 4) == free   # (same prefix-cache state after)
    # Stop each request on a token it produces mid-way, or cut it by max_tokens: the request is
    # already in the next (launched) step when its stop is seen.
    params = [SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, stop_token_ids=[free[0][0][4]]),
              SamplingParams(max_tokens=3, temperature=0, ignore_eos=True),
              SamplingParams(max_tokens=1, temperature=0, ignore_eos=True),
              SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, stop_token_ids=[free[3][0][6]])]
    want = _finish_all(plain, prompts, params)
    got = _finish_all(over, prompts, params)
    assert got == want
    assert [len(t) for t, _, _ in got][1:3] == [3, 1]
    assert got[0][1].value == "stop" and len(got[0][0]) <= 5


def test_seeded_sampling_and_penalties_identical(tiny_llama):
    prompts = random_prompts([6, 11, 9], 512, seed=3)
    params = [SamplingParams(max_tokens=10, temperature=0.9, top_p=0.9, seed=7, ignore_eos=True),
              SamplingParams(max_tokens=10, temperature=0.7, seed=8, ignore_eos=True, repetition_penalty=1.3),
              SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, frequency_penalty=0.5)]
    plain, over = pair(tiny_llama)
    assert _finish_all(over, prompts, params) == _finish_all(plain, prompts, params)
