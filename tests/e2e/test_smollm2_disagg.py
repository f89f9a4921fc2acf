"""The default model through the whole disaggregated stack (slow: two SmolLM2 processes)."""

from __future__ import annotations

import concurrent.futures as cf

import pytest

from tandem.engine.config import EngineConfig
from tandem.engine.engine import LLMEngine
from tandem.engine.sampling_params import SamplingParams
from tests.e2e.stack import Stack

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Water boils at",
           "Once upon a time, in a small village,"]


def test_smollm2_disagg_equals_colocated_engine():
    engine = LLMEngine(EngineConfig(model="smollm2-135m", dtype="float32", kv_cache_gb=0.25))
    expected = [r.token_ids for r in engine.generate(PROMPTS, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))]
    del engine
    stack = Stack("--model", "smollm2-135m", "--dtype", "float32", "--kv-cache-gb", "0.25", "--transfer-backend", "auto")
    try:
        with cf.ThreadPoolExecutor(4) as pool:
            outs = list(pool.map(lambda p: stack.generate(p, max_tokens=12, ignore_eos=True), PROMPTS))
        assert [list(o.token_ids) for o in outs] == expected
        assert "Paris" in outs[0].text
    finally:
        stack.close()
