"""Packed (oneDNN-layout) linear layers give exactly what the plain ones give."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.config import EngineConfig
from engine.engine import LLMEngine
from engine.errors import InvalidRequest
from engine.models.prepack import PackedLinear, prepack_linears, prepack_supported
from engine.sampling_params import SamplingParams
from tests.engine.test_engine_vs_hf import random_prompts

pytestmark = pytest.mark.skipif(not prepack_supported(torch.device("cpu"), torch.bfloat16),
                                reason="oneDNN has no bf16 on this CPU")


@pytest.mark.parametrize("rows", [1, 7, 33, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_is_bit_identical_to_f_linear(rows, bias):
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(96, 64, generator=g).bfloat16()
    b = torch.randn(96, generator=g).bfloat16() if bias else None
    x = torch.randn(rows, 64, generator=g).bfloat16()
    packed = PackedLinear(w, b)
    assert torch.equal(packed(x), F.linear(x, w, b))
    x3 = x.view(1, rows, 64)
    assert packed(x3).shape == (1, rows, 96) and torch.equal(packed(x3)[0], F.linear(x, w, b))
    xt = torch.randn(64, rows, generator=g).bfloat16().t()   # not contiguous
    assert torch.equal(packed(xt), F.linear(xt.contiguous(), w, b))


def test_prepack_linears_swaps_every_linear_and_keeps_others():
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(),
                              torch.nn.Sequential(torch.nn.Linear(16, 4, bias=False))).bfloat16()
    x = torch.randn(3, 8).bfloat16()
    want = net(x)
    assert prepack_linears(net) == 2
    assert not any(isinstance(m, torch.nn.Linear) for m in net.modules())
    assert isinstance(net[1], torch.nn.ReLU)
    assert torch.equal(net(x), want)


def _engine(tiny_llama, **kw) -> LLMEngine:
    cfg = EngineConfig(model=str(tiny_llama), dtype="bfloat16", kv_cache_gb=0.05, max_running_requests=8, **kw)
    return LLMEngine(cfg)


def test_prepacked_engine_gives_the_same_tokens_and_logprobs(tiny_llama):
    prompts = random_prompts([5, 17, 40, 3, 64, 9], plain_vocab := 250, seed=11)
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=True, top_logprobs=3)
    plain = _engine(tiny_llama, enable_weight_prepack=False)
    assert plain.model_config.vocab_size >= plain_vocab
    packed = _engine(tiny_llama, enable_weight_prepack=True)
    assert packed.runner.model.vocab_projection is not None and plain.runner.model.vocab_projection is None
    a, b = plain.generate(prompts, params), packed.generate(prompts, params)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert [o.logprobs for o in a] == [o.logprobs for o in b]


def test_prepack_is_the_cpu_bf16_default_and_refused_where_it_cannot_run(tiny_llama):
    assert _engine(tiny_llama).runner.model.vocab_projection is not None
    assert _engine(tiny_llama, enable_graph=True, graph_bs=(1,)).runner.model.vocab_projection is None
    with pytest.raises(InvalidRequest, match="bf16"):
        LLMEngine(EngineConfig(model=str(tiny_llama), dtype="float32", kv_cache_gb=0.05, enable_weight_prepack=True))
    with pytest.raises(InvalidRequest, match="graphs"):
        _engine(tiny_llama, enable_graph=True, enable_weight_prepack=True)
