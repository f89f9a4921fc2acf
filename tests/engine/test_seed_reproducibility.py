"""What docs/sampling.md promises about `seed`, checked: the same request in the same batch
composition (prefix cache off or in the same state) gives the same tokens, in bf16 too; the
random draws of a seeded request do not depend on its batch neighbours (tests/engine/runner/test_sampler.py)."""

from __future__ import annotations

import pytest

from tandem.engine.config import EngineConfig
from tandem.engine.engine import LLMEngine
from tandem.engine.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def engine(tiny_llama) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(tiny_llama), dtype="bfloat16", page_size=4, max_total_tokens=2048,
                                  context_length=128, enable_prefix_cache=False))


def test_same_seed_same_batch_composition_same_tokens(engine):
    seeded = SamplingParams(max_tokens=24, temperature=1.0, seed=7, ignore_eos=True)
    prompts = [list(range(20, 40)), list(range(50, 61)), list(range(70, 97))]
    params = [seeded, SamplingParams(max_tokens=24, temperature=0.8, seed=1, ignore_eos=True),
              SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)]
    alone = [engine.generate([prompts[0]], seeded)[0].token_ids for _ in range(2)]
    assert alone[0] == alone[1]
    batched = [[r.token_ids for r in engine.generate(prompts, params)] for _ in range(2)]
    assert batched[0] == batched[1]
    # Another seed is another sample (24 tokens of a 512-token vocab at temperature 1).
    assert engine.generate([prompts[0]], SamplingParams(max_tokens=24, temperature=1.0, seed=8,
                                                        ignore_eos=True))[0].token_ids != alone[0]
    engine.check_idle()
