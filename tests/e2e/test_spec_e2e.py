"""`tandem up` with speculative decoding: the flags reach the decode worker (not the prefill one),
greedy tokens through 1P1D equal plain co-located decoding, the decode worker's metrics count the
accepted drafts, and every page comes back."""

from __future__ import annotations

import dataclasses
import re
import urllib.request

import pytest

from tandem.engine.config import EngineConfig
from tandem.engine.engine import LLMEngine
from tandem.engine.sampling_params import SamplingParams
from tests.e2e.stack import Stack

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def _metric(worker: dict, name: str) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{worker['metrics_port']}/metrics", timeout=5).read().decode()
    m = re.search(rf"^{name} (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def test_1p1d_with_a_draft_model_gives_plain_greedy_tokens(tiny_llama):
    prompts = [list(range(5, 5 + n)) for n in (4, 19, 33)]
    stack = Stack("--model", str(tiny_llama), "--dtype", "float32", "--page-size", "4", "--max-total-tokens", "2048",
                  "--transfer-backend", "shm", "--speculative-algorithm", "draft",
                  "--speculative-draft-model", str(tiny_llama), "--disable-speculative-adaptive")
    try:
        got = [list(stack.generate(p, max_tokens=17, temperature=0, ignore_eos=True).token_ids) for p in prompts]
        [decode] = stack.workers("decode")
        [prefill] = stack.workers("prefill")
        accepted = _metric(decode, "tandem_spec_accepted_tokens_total")
        assert accepted > 0 and accepted == _metric(decode, "tandem_spec_draft_tokens_total")
        assert _metric(prefill, "tandem_spec_draft_tokens_total") == 0
        for w in (decode, prefill):
            free, total = stack.wait_pages_free(w)
            assert free == total
    finally:
        stack.close()
    base = EngineConfig(model=str(tiny_llama), dtype="float32", page_size=4, max_total_tokens=2048)
    ref = LLMEngine(dataclasses.replace(base)).generate(prompts, SamplingParams(max_tokens=17, temperature=0,
                                                                                ignore_eos=True))
    assert got == [r.token_ids for r in ref]
