"""Packed linear layers: oneDNN's layout (bf16) gives exactly what the plain ones give; the panel layout
of Tandem's fp32 kernel (kernels/cpu/linear.cpp) gives F.linear's results within fp32 rounding and
the same greedy tokens, with the packed vocab projection as the only copy of a tied embedding."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tandem.engine.config import EngineConfig
from tandem.engine.engine import LLMEngine
from tandem.engine.errors import InvalidRequest
from tandem.engine.models.prepack import (
    PackedLinear,
    PanelEmbedding,
    PanelLinear,
    prepack_linears,
    prepack_supported,
)
from tandem.engine.sampling_params import SamplingParams
from tandem.kernels.cpu import load
from tests.engine.test_engine_vs_hf import random_prompts

bf16 = pytest.mark.skipif(not prepack_supported(torch.device("cpu"), torch.bfloat16),
                          reason="oneDNN has no bf16 on this CPU")


@pytest.fixture(scope="module")
def ops():
    ops = load()
    assert ops is not None, "the CPU kernels did not build (run `python -m tandem.kernels.cpu -v`)"
    return ops


@bf16
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


@bf16
def test_prepack_linears_swaps_every_linear_and_keeps_others():
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(),
                              torch.nn.Sequential(torch.nn.Linear(16, 4, bias=False))).bfloat16()
    x = torch.randn(3, 8).bfloat16()
    want = net(x)
    assert prepack_linears(net) == 2
    assert not any(isinstance(m, torch.nn.Linear) for m in net.modules())
    assert isinstance(net[1], torch.nn.ReLU)
    assert torch.equal(net(x), want)


def _engine(path, dtype="bfloat16", **kw) -> LLMEngine:
    cfg = EngineConfig(model=str(path), dtype=dtype, kv_cache_gb=0.05, max_running_requests=8, **kw)
    return LLMEngine(cfg)


@bf16
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


@bf16
def test_prepack_is_the_cpu_bf16_default_and_refused_where_it_cannot_run(tiny_llama):
    assert _engine(tiny_llama).runner.model.vocab_projection is not None
    assert _engine(tiny_llama, enable_graph=True, graph_bs=(1,)).runner.model.vocab_projection is None
    with pytest.raises(InvalidRequest, match="graphs"):
        _engine(tiny_llama, enable_graph=True, enable_weight_prepack=True)


# --- fp32: Tandem's panel-packed linear kernel ------------------------------------------------------

def _fp32_close(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> None:
    """Within fp32 rounding of the exact product (any summation order): k * 2^-24 * |x| . |w|ᵀ."""
    want = F.linear(x.double(), w.double(), None if b is None else b.double())
    bound = x.shape[-1] * 2.0 ** -24 * F.linear(x.double().abs(), w.double().abs()) + want.abs() * 2.0 ** -24
    assert ((got.double() - want).abs() <= bound).all()


@pytest.mark.parametrize("rows", [1, 7, 33, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_panel_linear_matches_f_linear(ops, rows, bias):
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(100, 64, generator=g)
    b = torch.randn(100, generator=g) if bias else None
    x = torch.randn(rows, 64, generator=g)
    packed = PanelLinear(w, b, ops)
    _fp32_close(packed(x), x, w, b)
    x3 = x.view(1, rows, 64)
    assert packed(x3).shape == (1, rows, 100) and torch.equal(packed(x3)[0], packed(x))
    xt = torch.randn(64, rows, generator=g).t()                   # columns not of unit stride: copied
    assert torch.equal(packed(xt), packed(xt.contiguous()))


def test_panel_embedding_reads_the_packed_rows(ops):
    w = torch.randn(ops.LINEAR_PANEL * 2 + 5, 24)
    emb = PanelEmbedding(PanelLinear(w, None, ops))
    ids = torch.tensor([[0, 1, ops.LINEAR_PANEL, w.shape[0] - 1], [7, 7, 3, ops.LINEAR_PANEL * 2 + 2]])
    assert torch.equal(emb(ids), F.embedding(ids, w))


def test_prepack_linears_on_the_kernel(ops):
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4, bias=False))
    x = torch.randn(3, 8)
    want = net(x)
    assert prepack_linears(net, ops) == 2
    assert isinstance(net[0], PanelLinear) and isinstance(net[2], PanelLinear)
    torch.testing.assert_close(net(x), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("model", ["tiny_llama", "tiny_qwen2", "tiny_qwen3", "tied"])
def test_fp32_panel_engine_gives_the_same_greedy_tokens(request, tmp_path_factory, model):
    """Decode, chunked prefill and prefix hits on the kernel's linears (qkv biases in qwen2, an untied
    lm_head dropped, a tied embedding read from the packed vocab projection) against the plain ones."""
    if model == "tied":
        from tests.fixtures.tiny_models import make_tiny_model

        path = make_tiny_model(tmp_path_factory.mktemp("tied"), "llama", tie_word_embeddings=True)
    else:
        path = request.getfixturevalue(model)
    shared = random_prompts([40], 250, seed=3)[0]
    prompts = random_prompts([5, 17, 40, 3, 64, 9], 250, seed=11) + [shared + [7, 8], shared + [9]]
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    plain = _engine(path, "float32", enable_weight_prepack=False, chunked_prefill_size=24)
    packed = _engine(path, "float32", chunked_prefill_size=24)           # the fp32 default on CPU
    model_ = packed.runner.model
    assert isinstance(model_.vocab_projection, PanelLinear) and plain.runner.model.vocab_projection is None
    assert not any(type(m) is torch.nn.Linear for m in model_.modules())
    assert isinstance(model_.embed_tokens, PanelEmbedding) == (model == "tied")
    assert model_.lm_head is None and model_._vocab_weight() is None
    a, b = plain.generate(prompts, params), packed.generate(prompts, params)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    packed.check_idle()


def test_fp32_prepack_needs_the_cpu_kernels(tiny_llama):
    assert _engine(tiny_llama, "float32", enable_cpu_kernels=False).runner.model.vocab_projection is None
    with pytest.raises(InvalidRequest, match="CPU kernels"):
        _engine(tiny_llama, "float32", enable_cpu_kernels=False, enable_weight_prepack=True)
    assert _engine(tiny_llama, "float32", enable_weight_prepack=True).runner.model.vocab_projection is not None
