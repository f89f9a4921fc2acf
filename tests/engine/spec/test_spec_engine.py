"""Speculative decoding in the engine: the same greedy tokens as without it (through arrivals,
retraction and aborts), stop conditions cut inside an accepted run, draft == target accepts
everything, seeded sampling repeats and keeps its token distribution, and every page comes back."""

from __future__ import annotations

import math
from collections import Counter

import pytest

from tandem.engine.outputs import FinishReason
from tandem.engine.sampling_params import SamplingParams
from tests.engine.test_engine_vs_hf import greedy, make_engine, random_prompts
from tests.engine.test_mixed_chunk_engine import run_staggered


def _repetitive(lengths, seed):
    # Prompts that repeat themselves give the n-gram proposer something to find.
    return [p + p[: len(p) // 2] + p for p in random_prompts(lengths, 512, seed=seed)]


def ngram(path, **kw):
    kw.setdefault("speculative_adaptive", False)
    return make_engine(path, speculative_algorithm="ngram", speculative_ngram_min=1, speculative_ngram_max=3, **kw)


def draft_is_target(path, **kw):
    kw.setdefault("speculative_adaptive", False)
    return make_engine(path, speculative_algorithm="draft", speculative_draft_model=str(path), **kw)


@pytest.mark.parametrize("make", [ngram, draft_is_target], ids=["ngram", "draft"])
@pytest.mark.parametrize("pool_tokens", [2048, 96], ids=["roomy", "tight-retracts"])
def test_greedy_tokens_equal_plain_decoding(tiny_llama, pool_tokens, make):
    # A random-weight model does not copy its prompt, so n-gram drafts are mostly rejected here
    # (the rollback path); the draft model equal to the target gets them accepted.
    prompts = _repetitive([9, 14, 4, 11], seed=21)
    kw = dict(chunked_prefill_size=16, max_total_tokens=pool_tokens)
    if pool_tokens < 100:
        kw.update(init_new_token_ratio=0.01, min_new_token_ratio=0.01)
    plain, _ = run_staggered(make_engine(tiny_llama, **kw), prompts, 24)
    spec_engine = make(tiny_llama, **kw)
    spec, _ = run_staggered(spec_engine, prompts, 24)
    assert spec == plain
    stats = spec_engine.spec.stats
    assert stats.drafted_tokens > 0 and stats.verify_steps > 0
    if make is draft_is_target:
        assert stats.accepted_tokens == stats.drafted_tokens
    if pool_tokens < 100:
        assert spec_engine.scheduler.num_retractions > 0


def test_abort_mid_run_frees_everything(tiny_llama):
    prompts = _repetitive([10, 6, 13], seed=22)
    alone, _ = run_staggered(make_engine(tiny_llama), prompts, 20, abort_at=1)
    spec, _ = run_staggered(draft_is_target(tiny_llama), prompts, 20, abort_at=1)   # check_idle inside
    assert spec[0] == alone[0] and spec[2] == alone[2]


def test_draft_model_equal_to_the_target_accepts_every_draft(tiny_llama):
    prompts = random_prompts([7, 25, 3], 512, seed=23)
    plain = make_engine(tiny_llama).generate(prompts, greedy(30))
    engine = draft_is_target(tiny_llama)
    spec = engine.generate(prompts, greedy(30))
    assert [r.token_ids for r in spec] == [r.token_ids for r in plain]
    stats = engine.spec.stats
    assert stats.drafted_tokens > 0 and stats.accepted_tokens == stats.drafted_tokens
    assert stats.accept_lengths[-1] > 0 and stats.mean_accept_length > 3
    engine.check_idle()


def test_stop_conditions_inside_an_accepted_run_cut_the_output(tiny_llama):
    prompt = random_prompts([12], 512, seed=24)[0]
    plain_engine = make_engine(tiny_llama)
    full = plain_engine.generate([prompt], greedy(30))[0]
    stop_tok = full.token_ids[6]
    stop_text = plain_engine.tokenizer.decode(full.token_ids[9:11])
    cases = [
        SamplingParams(max_tokens=30, temperature=0.0, stop_token_ids=[stop_tok]),
        SamplingParams(max_tokens=7, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, stop=[stop_text]),
        SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, logprobs=True, top_logprobs=2),
    ]
    spec_engine = draft_is_target(tiny_llama)
    for params in cases:
        ref = plain_engine.generate([prompt], params)[0]
        got = spec_engine.generate([prompt], params)[0]
        assert (got.token_ids, got.text, got.finish_reason, got.matched_stop, got.usage.completion_tokens) == \
            (ref.token_ids, ref.text, ref.finish_reason, ref.matched_stop, ref.usage.completion_tokens), params
        if params.logprobs:
            assert [(lp.token_id, [t for t, _ in lp.top]) for lp in got.logprobs] == \
                [(lp.token_id, [t for t, _ in lp.top]) for lp in ref.logprobs]
            assert all(abs(g.logprob - r.logprob) < 1e-3 for g, r in zip(got.logprobs, ref.logprobs, strict=True))
    assert spec_engine.spec.stats.accepted_tokens > 0
    assert ref.finish_reason is FinishReason.LENGTH
    spec_engine.check_idle()


def test_penalised_requests_are_not_speculated(tiny_llama):
    engine = draft_is_target(tiny_llama)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, repetition_penalty=1.3)
    prompt = random_prompts([9], 512, seed=25)[0]
    assert engine.generate([prompt], params)[0].token_ids == make_engine(tiny_llama).generate([prompt], params)[0].token_ids
    assert engine.spec.stats.drafted_tokens == 0
    engine.check_idle()


@pytest.mark.parametrize("top_k", [-1, 20])
@pytest.mark.parametrize("make", [ngram, draft_is_target], ids=["ngram", "draft"])
def test_seeded_sampling_gives_the_tokens_of_plain_sampling(tiny_llama, make, top_k):
    # verify() draws each emitted token with the uniform plain sampling would use for it. (Rows of
    # one batch share their filters here: the plain sampler's candidate order, and so its pick for
    # a uniform, depends on whether any row of the batch filters, see docs/sampling.md.)
    prompts = _repetitive([8, 12, 5], seed=26)
    params = [SamplingParams(max_tokens=20, temperature=t, seed=s, ignore_eos=True, top_k=top_k)
              for t, s in ((0.8, 1), (1.0, 2), (0.6, 3))]
    plain = make_engine(tiny_llama).generate(prompts, params)
    engine = make(tiny_llama)
    spec = engine.generate(prompts, params)
    assert [r.token_ids for r in spec] == [r.token_ids for r in plain]
    assert engine.spec.stats.drafted_tokens > 0
    engine.check_idle()


def _chi2_same_distribution(a: Counter, b: Counter) -> float:
    """p-value of a chi-square homogeneity test of two samples of tokens (sparse tokens pooled;
    Wilson-Hilferty approximation of the chi-square tail)."""
    na, nb = sum(a.values()), sum(b.values())
    bins, rest = [], [0, 0]
    for t in set(a) | set(b):
        if a[t] + b[t] >= 10:
            bins.append((a[t], b[t]))
        else:
            rest[0] += a[t]
            rest[1] += b[t]
    bins.append(tuple(rest))
    chi2 = 0.0
    for x, y in bins:
        tot = x + y
        for obs, n in ((x, na), (y, nb)):
            exp = tot * n / (na + nb)
            chi2 += (obs - exp) ** 2 / exp if exp else 0.0
    df = len(bins) - 1
    z = ((chi2 / df) ** (1 / 3) - (1 - 2 / (9 * df))) / math.sqrt(2 / (9 * df))
    return 0.5 * math.erfc(z / math.sqrt(2))


@pytest.mark.parametrize("make", [ngram, draft_is_target], ids=["ngram", "draft"])
def test_sampled_token_frequencies_match_plain_sampling(tiny_llama, make):
    prompt = _repetitive([6], seed=27)[0]
    n = 240
    params = [SamplingParams(max_tokens=6, temperature=0.7, seed=1000 + i, ignore_eos=True) for i in range(n)]
    kw = dict(max_running_requests=64, max_total_tokens=4096)
    plain = make_engine(tiny_llama, **kw).generate([prompt] * n, params)
    spec_engine = make(tiny_llama, **kw)
    spec = spec_engine.generate([prompt] * n, [SamplingParams(max_tokens=6, temperature=0.7, seed=5000 + i,
                                                             ignore_eos=True) for i in range(n)])
    stats = spec_engine.spec.stats
    assert stats.drafted_tokens > 0
    if make is draft_is_target:     # a greedy draft is accepted with probability p(argmax)
        assert stats.accepted_tokens > 100 and stats.accepted_tokens < stats.drafted_tokens
    for pos in (1, 3, 5):   # positions after verified drafts
        a = Counter(r.token_ids[pos] for r in plain)
        b = Counter(r.token_ids[pos] for r in spec)
        assert _chi2_same_distribution(a, b) > 1e-3, (pos, a.most_common(5), b.most_common(5))
    spec_engine.check_idle()
