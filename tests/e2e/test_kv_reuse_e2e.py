"""KV both ways in a live 1P1D deployment (`tandem up`, embedded Redis, KV events on): turn 2 of a
conversation repeats turn 1's answer, which only the decode worker computed; with --kv-reuse-policy
always the router asks the prefill worker to fetch it (KVSource.SendPrefix over gRPC, the KV over the
default transfer backend), the prefill worker computes only the rest, and the greedy tokens equal a
co-located engine's. Both workers end with every page free."""

from __future__ import annotations

import dataclasses

import pytest

from tandem.engine.config import EngineConfig
from tandem.engine.engine import LLMEngine
from tandem.engine.sampling_params import SamplingParams
from tests.e2e.stack import Stack
from tests.e2e.test_kv_events_e2e import router_metric, wait_for

pytestmark = pytest.mark.timeout(240)

ENGINE = ("--dtype", "float32", "--page-size", "4", "--max-total-tokens", "1024")
TURN1 = [(7 * i + 3) % 500 + 3 for i in range(60)]
NEW = [41, 42, 43, 44, 45, 46]


def test_turn_two_fetches_the_answer_from_the_decode_worker(tiny_llama):
    engine = LLMEngine(dataclasses.replace(EngineConfig(dtype="float32", page_size=4), model=str(tiny_llama)))
    greedy = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    try:
        first = engine.generate([TURN1], greedy)[0].token_ids
        expected = engine.generate([TURN1 + first + NEW], greedy)[0].token_ids
    finally:
        engine.close()
    stack = Stack("--model", str(tiny_llama), *ENGINE, "--kv-reuse-policy", "always")
    try:
        (prefill,), (decode,) = stack.workers("prefill"), stack.workers("decode")
        wait_for(lambda: router_metric(stack, "tandem_router_kv_exact_workers") == 2)
        got1 = stack.generate(TURN1, max_tokens=16, ignore_eos=True)
        assert list(got1.token_ids) == first
        # The router hears what each caches before turn 2 is routed: P the prompt's 15 pages, D 18 (the
        # prompt and the 15 answer tokens with KV there).
        wait_for(lambda: router_metric(stack, "tandem_router_kv_events_applied_total") >= 15 + 18)
        got2 = stack.generate(TURN1 + first + NEW, max_tokens=16, ignore_eos=True)
        assert list(got2.token_ids) == expected
        fetched = stack.metric(prefill, "tandem_kv_fetched_tokens_total")
        assert fetched >= 12, stack.log                     # the answer's full pages (15 tokens with KV on D)
        assert got2.usage.cached_tokens >= 60 + fetched - 4
        assert router_metric(stack, "tandem_router_kv_reuse_total") == 1
        assert all(free == total for free, total in map(stack.wait_pages_free, (prefill, decode)))
    finally:
        stack.close()
