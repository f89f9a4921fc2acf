"""Speculative decoding on the disaggregated decode worker (first token from P): the same tokens as
the co-located engine, greedy and seeded, and every page on both sides freed."""

from __future__ import annotations

import dataclasses

import pytest

from tandem.engine.engine import LLMEngine
from tandem.engine.sampling_params import SamplingParams
from tandem.kvtransfer import create_receiver, create_sender
from tandem.services.decode.worker import DecodeTimeouts, DecodeWorker
from tandem.services.prefill.worker import PrefillTimeouts, PrefillWorker
from tandem.services.worker.layout import layout_of
from tandem.services.worker.spec_metrics import SpecMetrics
from tests.services.test_pd_workers import BASE, DirectPeers, drive, submit


def spec_cfg(path, algo):
    extra = dict(speculative_draft_model=str(path)) if algo == "draft" else dict(speculative_ngram_min=1)
    return dataclasses.replace(BASE, model=str(path), speculative_algorithm=algo, speculative_adaptive=False, **extra)


@pytest.fixture(params=["ngram", "draft"])
def spec_pair(tiny_llama, request):
    engine_p = LLMEngine(dataclasses.replace(BASE, model=str(tiny_llama), init_new_token_ratio=0, min_new_token_ratio=0))
    holder = {}

    def allocate(spec):
        holder["rx"] = create_receiver("tcp", layout_of(spec), "127.0.0.1", "d")
        return holder["rx"].buffer

    engine_d = LLMEngine(spec_cfg(tiny_llama, request.param), kv_allocator=allocate)
    sender = create_sender("tcp", engine_p.runner.pool.buffer, layout_of(engine_p.runner.pool.spec), "p")
    prefill = PrefillWorker(engine_p, sender, PrefillTimeouts(bootstrap_s=1.0, transfer_s=5.0))
    peers = DirectPeers(prefill, holder["rx"])
    decode = DecodeWorker(engine_d, holder["rx"], DecodeTimeouts(transfer_s=10.0), peers)
    peers.decode = decode
    yield prefill, decode, request.param
    sender.close()
    holder["rx"].close()


def test_decode_worker_speculates_and_matches_colocated(spec_pair, tiny_llama):
    prefill, decode, algo = spec_pair
    prompts = [list(range(3, 3 + n)) * 2 for n in (5, 18, 9)]
    params = [SamplingParams(max_tokens=14, temperature=0, ignore_eos=True),
              SamplingParams(max_tokens=14, temperature=0.9, seed=7, ignore_eos=True),
              SamplingParams(max_tokens=9, temperature=0, stop_token_ids=[]), ]
    results, responses = {}, []
    for i, (p, sp) in enumerate(zip(prompts, params, strict=True)):
        submit(prefill, decode, 200 + i, p, sp, results, responses)
    drive(prefill, decode, lambda: len(responses) == 3 and not decode.streams, timeout_s=60)
    # Co-located with and without speculation: the seeded row draws the same uniforms in all three.
    colocated = LLMEngine(spec_cfg(tiny_llama, algo)).generate(prompts, params)
    plain = LLMEngine(dataclasses.replace(BASE, model=str(tiny_llama))).generate(prompts, params)
    for i, ref in enumerate(colocated):
        got = [t for o in results[f"r{200 + i}"] for t in o.token_ids]
        assert got == ref.token_ids == plain[i].token_ids, i
    stats = decode.engine.spec.stats
    assert stats.drafted_tokens > 0
    if algo == "draft":
        assert stats.accepted_tokens > 0
    prefill.engine.check_idle()
    decode.engine.check_idle()


def test_spec_metrics_export_deltas(tiny_llama):
    from tandem.services.worker import metrics

    engine = LLMEngine(spec_cfg(tiny_llama, "draft"))
    exporter = SpecMetrics(engine.spec)
    before = metrics.SPEC_ACCEPTED_TOKENS._value.get()
    rows_before = metrics.SPEC_VERIFIED_ROWS._value.get()
    engine.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    exporter.after_step(0.0)
    exporter.after_step(0.0)   # nothing new: nothing counted twice
    stats = engine.spec.stats
    assert metrics.SPEC_ACCEPTED_TOKENS._value.get() - before == stats.accepted_tokens > 0
    assert metrics.SPEC_VERIFIED_ROWS._value.get() - rows_before == sum(stats.accept_lengths)
    engine.check_idle()
