"""The fused CPU kernels (kernels/cpu) against the torch code they replace, and the engine with them
on against the engine with them off. `make install` builds them; a machine where they cannot be built
fails here rather than silently testing the fallback."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.config import EngineConfig
from engine.engine import LLMEngine
from engine.errors import InvalidRequest
from engine.models.layers import RMSNorm
from engine.models.rope import _rotate
from engine.sampling_params import SamplingParams
from kernels.cpu import load
from tests.engine.test_engine_vs_hf import random_prompts


@pytest.fixture(scope="module")
def ops():
    ops = load()
    assert ops is not None, "the CPU kernels did not build (run `python -m kernels.cpu -v`)"
    return ops


def _cache(num_pages, page_size, kv_heads, dim, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    shape = (num_pages, page_size, kv_heads, dim)
    return torch.randn(shape, generator=g).to(dtype), torch.randn(shape, generator=g).to(dtype)


def _reference(q, k_cache, v_cache, tables, kv_lens, scale):
    """fp32 SDPA per row over its first kv_len slots."""
    out = []
    for i, n in enumerate(kv_lens.tolist()):
        pages = tables[i].long()
        k = k_cache[pages].flatten(0, 1)[:n].float().transpose(0, 1)     # [KVH, n, D]
        v = v_cache[pages].flatten(0, 1)[:n].float().transpose(0, 1)
        out.append(F.scaled_dot_product_attention(q[i].float()[:, None], k, v, scale=scale, enable_gqa=True)[:, 0])
    return torch.stack(out)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2), (torch.float16, 2e-3)])
@pytest.mark.parametrize("heads,kv_heads,dim", [(9, 3, 64), (4, 4, 128), (6, 2, 32), (8, 1, 24)])
def test_decode_attention_matches_fp32_sdpa(ops, dtype, tol, heads, kv_heads, dim):
    page_size, num_pages = 4, 40
    k_cache, v_cache = _cache(num_pages, page_size, kv_heads, dim, dtype, seed=dim)
    g = torch.Generator().manual_seed(heads)
    kv_lens = torch.tensor([1, 4, 5, 17, 30])                 # one key; exactly one page; partial last pages
    max_pages = 8
    tables = torch.randperm(num_pages, generator=g)[: 5 * max_pages].view(5, max_pages).int()
    # q as the model hands it over: a strided view into a wider qkv row.
    qkv = torch.randn(5, (heads + 2 * kv_heads) * dim, generator=g).to(dtype)
    q = qkv[:, : heads * dim].view(5, heads, dim)
    got = ops.paged_decode_attention(q, k_cache, v_cache, tables, kv_lens, 0.3)
    assert got.shape == (5, heads, dim) and got.dtype == dtype
    torch.testing.assert_close(got.float(), _reference(q, k_cache, v_cache, tables, kv_lens, 0.3), atol=tol, rtol=tol)


def test_decode_attention_refuses_bad_input(ops):
    k_cache, v_cache = _cache(4, 4, 1, 16, torch.float32, seed=0)
    q = torch.randn(1, 2, 16)
    ok = torch.tensor([[0, 1]], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="kv_lens"):
        ops.paged_decode_attention(q, k_cache, v_cache, ok, torch.tensor([9]), 1.0)   # past the table
    with pytest.raises(RuntimeError, match="kv_lens"):
        ops.paged_decode_attention(q, k_cache, v_cache, ok, torch.tensor([0]), 1.0)
    with pytest.raises(RuntimeError, match="outside the cache"):
        ops.paged_decode_attention(q, k_cache, v_cache, torch.tensor([[0, 7]], dtype=torch.int32),
                                   torch.tensor([6]), 1.0)
    with pytest.raises(RuntimeError, match="int32"):
        ops.paged_decode_attention(q, k_cache, v_cache, ok.long(), torch.tensor([3]), 1.0)
    with pytest.raises(RuntimeError, match="dtype"):
        ops.paged_decode_attention(q.double(), k_cache, v_cache, ok, torch.tensor([3]), 1.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 5, 300])
def test_rms_norm_matches_the_torch_code(ops, dtype, tokens):
    g = torch.Generator().manual_seed(tokens)
    norm = RMSNorm(576, 1e-5).to(dtype)
    norm.weight.data = torch.randn(576, generator=g).to(dtype)
    x = torch.randn(tokens, 576, generator=g).to(dtype)
    residual = torch.randn(tokens, 576, generator=g) * 4
    want, want_residual = norm.add_forward(x, residual.clone())
    got_residual = residual.clone()
    got = ops.rms_norm(x, got_residual, norm.weight, 1e-5)
    assert torch.equal(got_residual, want_residual)              # residual += x, in place, bit for bit
    # The sum of squares adds in another order: at most one rounding step of the output apart.
    tol = 1e-6 if dtype == torch.float32 else 8e-3
    torch.testing.assert_close(got, want, atol=tol * 4, rtol=tol)
    torch.testing.assert_close(ops.rms_norm(x, None, norm.weight, 1e-5), norm(x), atol=tol * 4, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_is_bit_identical_to_the_torch_code(ops, dtype):
    g = torch.Generator().manual_seed(1)
    qkv = torch.randn(7, (9 + 2 * 3) * 64, generator=g).to(dtype)
    q, k, _ = qkv.split([9 * 64, 3 * 64, 3 * 64], dim=-1)
    q, k = q.view(7, 9, 64), k.view(7, 3, 64)
    cos, sin = torch.randn(7, 1, 32, generator=g), torch.randn(7, 1, 32, generator=g)
    want_q, want_k = _rotate(q, cos, sin), _rotate(k, cos, sin)
    ops.rope_(q, k, cos.squeeze(1), sin.squeeze(1))
    assert torch.equal(q, want_q) and torch.equal(k, want_k)
    assert torch.equal(qkv[:, : 9 * 64].view(7, 9, 64), want_q)    # rotated where it lies


def _engine(path, **kw) -> LLMEngine:
    cfg = dict(model=str(path), dtype="float32", kv_cache_gb=0.05, max_running_requests=8, page_size=4)
    return LLMEngine(EngineConfig(**{**cfg, **kw}))


@pytest.mark.parametrize("model", ["tiny_llama", "tiny_qwen2", "tiny_qwen3"])
def test_engine_with_kernels_gives_the_same_greedy_tokens(request, model):
    """Decode, chunked prefill (a later chunk over its own prefix), prefix-cache hits and mixed steps."""
    path = request.getfixturevalue(model)
    shared = random_prompts([40], 250, seed=3)[0]
    prompts = random_prompts([5, 17, 40, 3, 64, 9], 250, seed=11) + [shared + [7, 8], shared + [9]]
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    kw = dict(chunked_prefill_size=24)
    plain = _engine(path, enable_cpu_kernels=False, **kw)
    fused = _engine(path, enable_cpu_kernels=True, **kw)
    assert fused.runner.cpu_ops is not None and plain.runner.cpu_ops is None
    assert fused.runner.attn.cpu_ops is not None
    a, b = plain.generate(prompts, params), fused.generate(prompts, params)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]


def test_kernels_are_the_cpu_default_and_refused_with_graphs(tiny_llama):
    assert _engine(tiny_llama).runner.cpu_ops is not None
    assert _engine(tiny_llama, enable_graph=True, graph_bs=(1,)).runner.cpu_ops is None
    with pytest.raises(InvalidRequest, match="graphs"):
        _engine(tiny_llama, enable_graph=True, graph_bs=(1,), enable_cpu_kernels=True)
