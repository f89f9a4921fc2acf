"""The KV tiers under disaggregation: a prefill and a decode worker (one process, real tcp transfer),
each with pools too small to keep a conversation while another one runs. The next turn of the
conversation loads its history from the tiers on both sides — P the prompt pages it computes on, D
the pages it holds (prompt and answer), so P sends only the pages D lacks — and its greedy tokens
equal the co-located engine's with no tiers at all. Variants: each worker with its own host memory
(L2), and both sharing one disk directory (L3 only: D's demoted answer pages are readable by P)."""

from __future__ import annotations

import dataclasses

import pytest

from tandem.engine.engine import LLMEngine
from tandem.engine.sampling_params import SamplingParams
from tandem.services.decode.worker import DecodeTimeouts
from tandem.services.prefill.worker import PrefillTimeouts
from tandem.v1 import worker_pb2
from tests.services.test_pd_workers import BASE, drive, make_pair, submit

# Pages of 4 tokens, 12 per worker: one 39-token prompt and its answer fit, not two conversations.
SMALL = dataclasses.replace(BASE, max_total_tokens=48, max_running_requests=2, context_length=128)
PREFIX = [(7 * i + 3) % 500 + 3 for i in range(36)]     # 9 full pages shared by the two turns
A = PREFIX + [11, 12, 13]
B = [(5 * i + 1) % 500 + 3 for i in range(42)]         # another conversation: evicts all of A on P and D
A2 = PREFIX + [21, 22, 23]                             # the next turn of A
GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def colocated(tiny_llama) -> list[list[int]]:
    engine = LLMEngine(dataclasses.replace(BASE, model=str(tiny_llama)))
    try:
        return [engine.generate([p], GREEDY)[0].token_ids for p in (A, B, A2)]
    finally:
        engine.close()


def tiers(kind: str, tmp_path) -> dict:
    if kind == "l2":
        return dict(kv_host_cache_gb=0.01)
    return dict(kv_disk_cache_dir=str(tmp_path / "l3"), kv_disk_cache_gb=0.01)   # one directory, both workers


@pytest.mark.parametrize("kind", ["l2", "l3-shared"])
def test_next_turn_loads_its_history_on_both_sides(tiny_llama, colocated, tmp_path, kind):
    base = dataclasses.replace(SMALL, **tiers(kind, tmp_path))
    prefill, decode, peers = make_pair(tiny_llama, PrefillTimeouts(bootstrap_s=5.0, transfer_s=5.0),
                                       DecodeTimeouts(transfer_s=5.0), base)
    try:
        assert prefill.engine.kv_tiers is not None and decode.engine.kv_tiers is not None
        results, responses = {}, []
        for i, prompt in enumerate((A, B, A2)):
            submit(prefill, decode, 10 + i, prompt, GREEDY, results, responses)
            drive(prefill, decode, lambda n=i + 1: len(responses) == n and not decode.streams)
        got = [[t for o in results[f"r{10 + i}"] for t in o.token_ids] for i in range(3)]
        assert got == colocated
        assert all(r.state == worker_pb2.TRANSFER_STATE_SUCCESS for r in responses)
        # Turn 2 of A: P computed on loaded history, D held it, so P sent only the pages D lacked.
        assert prefill.engine.scheduler.kv.num_loaded_pages >= 8
        assert decode.engine.scheduler.kv.num_loaded_pages >= 9
        assert responses[2].cached_tokens >= 32
        assert responses[2].transfer_bytes < responses[0].transfer_bytes / 4
        prefill.engine.check_idle()
        decode.engine.check_idle()
    finally:
        prefill.sender.close()
        peers.receiver.close()
        prefill.engine.close()
        decode.engine.close()
