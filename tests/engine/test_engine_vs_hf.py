"""Greedy tokens from Tandem's engine equal Hugging Face `generate`, token for token (fp32)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers import AutoModelForCausalLM

from tandem.engine.config import EngineConfig
from tandem.engine.engine import LLMEngine
from tandem.engine.sampling_params import SamplingParams

ARCHS = ["tiny_llama", "tiny_qwen2", "tiny_qwen3"]


def hf_greedy(hf_model, prompt: list[int], n: int) -> list[int]:
    out = hf_model.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                            pad_token_id=0)
    return out[0, len(prompt):].tolist()


def random_prompts(lengths, vocab, seed=0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def make_engine(path, **kw) -> LLMEngine:
    base = EngineConfig(model=str(path), dtype="float32", page_size=4, max_total_tokens=2048)
    return LLMEngine(dataclasses.replace(base, **kw))


@pytest.fixture(scope="module", params=ARCHS)
def model_pair(request):
    path = request.getfixturevalue(request.param)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return path, hf


def test_single_prompts(model_pair):
    path, hf = model_pair
    engine = make_engine(path)
    for prompt in random_prompts([1, 7, 33], engine.model_config.vocab_size):
        [res] = engine.generate([prompt], greedy(10))
        assert res.token_ids == hf_greedy(hf, prompt, 10)
        assert res.usage.prompt_tokens == len(prompt) and res.usage.completion_tokens == 10
    engine.check_idle()


def test_batch_of_different_lengths(model_pair):
    path, hf = model_pair
    engine = make_engine(path)
    prompts = random_prompts([3, 18, 5, 40, 11, 26], engine.model_config.vocab_size, seed=1)
    results = engine.generate(prompts, greedy(12))
    for prompt, res in zip(prompts, results, strict=True):
        assert res.token_ids == hf_greedy(hf, prompt, 12)
    engine.check_idle()


def test_prefix_cache_hit(model_pair):
    path, hf = model_pair
    engine = make_engine(path)
    [shared] = random_prompts([21], engine.model_config.vocab_size, seed=2)
    first = engine.generate([shared + [5, 6, 7]], greedy(6))[0]
    assert first.usage.cached_tokens == 0
    second_prompt = shared + [9, 10, 11, 12]
    second = engine.generate([second_prompt], greedy(8))[0]
    assert second.usage.cached_tokens == 20  # 5 whole pages of 4 tokens are shared
    assert second.token_ids == hf_greedy(hf, second_prompt, 8)
    engine.check_idle()


def test_chunked_prefill(model_pair):
    path, hf = model_pair
    engine = make_engine(path, chunked_prefill_size=8)
    prompts = random_prompts([45, 3, 29], engine.model_config.vocab_size, seed=3)
    results = engine.generate(prompts, greedy(7))
    for prompt, res in zip(prompts, results, strict=True):
        assert res.token_ids == hf_greedy(hf, prompt, 7)
    engine.check_idle()


def test_retraction_with_tiny_pool(model_pair):
    path, hf = model_pair
    # 12 pages of 4 tokens; admission trusts that requests stop early (ratio 0), so decode runs
    # out of pages and must retract and later recompute.
    engine = make_engine(path, max_total_tokens=48, init_new_token_ratio=0.0, min_new_token_ratio=0.0,
                         enable_prefix_cache=True)
    prompts = random_prompts([6, 9, 5, 7], engine.model_config.vocab_size, seed=4)
    results = engine.generate(prompts, greedy(14))
    assert engine.scheduler.num_retractions > 0
    for prompt, res in zip(prompts, results, strict=True):
        assert res.token_ids == hf_greedy(hf, prompt, 14)
    engine.check_idle()
