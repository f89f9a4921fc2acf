"""The fused CPU kernels (kernels/cpu) against the torch code they replace, on every ISA variant this
CPU can run (generic, avx2, avx512, avx512_bf16 on a Zen 4), and the engine with them on against the
engine with them off. `make install` builds them; a machine where they cannot be built fails here
rather than silently testing the fallback."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tandem.engine.config import EngineConfig
from tandem.engine.engine import LLMEngine
from tandem.engine.errors import InvalidRequest
from tandem.engine.models.layers import RMSNorm
from tandem.engine.models.rope import _rotate
from tandem.engine.sampling_params import SamplingParams
from tests.engine.test_engine_vs_hf import random_prompts


def _cache(num_pages, page_size, kv_heads, dim, dtype, seed, layers=0):
    """K and V `[num_pages, page_size, kv_heads, dim]`; with `layers`, as the last layer's views of a
    page-first pool `[num_pages, layers, 2, page_size, kv_heads, dim]` (pages strided)."""
    g = torch.Generator().manual_seed(seed)
    if layers:
        pool = torch.randn(num_pages, layers, 2, page_size, kv_heads, dim, generator=g).to(dtype)
        return pool[:, -1, 0], pool[:, -1, 1]
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
@pytest.mark.parametrize("layers", [0, 3], ids=["contiguous", "page_first"])
def test_decode_attention_matches_fp32_sdpa(ops, dtype, tol, heads, kv_heads, dim, layers):
    page_size, num_pages = 4, 40
    k_cache, v_cache = _cache(num_pages, page_size, kv_heads, dim, dtype, seed=dim, layers=layers)
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
    with pytest.raises(RuntimeError, match="each page contiguous"):     # slots not contiguous in a page
        ops.paged_decode_attention(q, k_cache.transpose(0, 1), v_cache.transpose(0, 1), ok, torch.tensor([3]), 1.0)
    with pytest.raises(RuntimeError, match="equal strides"):
        ops.paged_decode_attention(q, k_cache, _cache(4, 4, 1, 16, torch.float32, seed=0, layers=2)[1], ok,
                                   torch.tensor([3]), 1.0)


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


def _extend_reference(q, k_cache, v_cache, table, kv_len, scale):
    """fp32 SDPA of n new tokens (the last n of kv_len) over the first kv_len slots of `table`."""
    n = q.shape[0]
    k = k_cache[table.long()].flatten(0, 1)[:kv_len].float().transpose(0, 1)     # [KVH, L, D]
    v = v_cache[table.long()].flatten(0, 1)[:kv_len].float().transpose(0, 1)
    mask = torch.arange(kv_len)[None, :] <= (kv_len - n + torch.arange(n))[:, None]
    out = F.scaled_dot_product_attention(q.float().transpose(0, 1), k, v, attn_mask=mask, scale=scale,
                                         enable_gqa=True)
    return out.transpose(0, 1)


# Within the dtype's rounding of the exact result: fp32 sums in another order; bf16 and fp16 round the
# output once (scores and probabilities stay fp32, or ~16 bits in the avx512_bf16 variant's bf16 pairs).
EXTEND_TOL = {torch.float32: (2e-5, 2e-5), torch.bfloat16: (2e-3, 4e-3), torch.float16: (5e-4, 1e-3)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,dim", [(9, 3, 64), (4, 2, 128), (8, 8, 64)])
@pytest.mark.parametrize("tokens,prefix", [(1, 0), (5, 0), (40, 0), (300, 0), (17, 23), (64, 300), (33, 1),
                                           (130, 250)])
def test_extend_attention_matches_fp32_sdpa(ops, dtype, heads, kv_heads, dim, tokens, prefix):
    """Prefill (no prefix), a later chunk or a prefix-cache hit (prefix > 0): several softmax chunks
    (120 keys in fp32 compute, 256 in bf16 pairs), row blocks with a partial last one (24 or 48 rows in
    fp32 compute, 32 tokens in bf16 pairs), partial pages, pages in shuffled order."""
    page_size, kv_len = 16, prefix + tokens
    num_pages = -(-kv_len // page_size) + 3
    k_cache, v_cache = _cache(num_pages, page_size, kv_heads, dim, dtype, seed=tokens)
    g = torch.Generator().manual_seed(prefix)
    table = torch.randperm(num_pages, generator=g)[: -(-kv_len // page_size)].int()
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=g).to(dtype)
    q = qkv[:, : heads * dim].view(tokens, heads, dim)     # a strided view, as the model hands it over
    assert ops.extend_attention_supported(dtype, dim)
    got = ops.paged_extend_attention(q, k_cache, v_cache, table, kv_len, dim ** -0.5)
    assert got.shape == (tokens, heads, dim) and got.dtype == dtype
    ref = _extend_reference(q, k_cache, v_cache, table, kv_len, dim ** -0.5)
    atol, rtol = EXTEND_TOL[dtype]
    torch.testing.assert_close(got.float(), ref, atol=atol, rtol=rtol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("tokens,prefix", [(40, 0), (17, 300)])
def test_extend_attention_reads_a_page_first_pool(ops, dtype, tokens, prefix):
    """A layer's K/V views of a page-first pool (pages strided, each page contiguous) read as the same
    pages copied out contiguously, bit for bit."""
    page_size, kv_len = 16, prefix + tokens
    num_pages = -(-kv_len // page_size) + 2
    k_cache, v_cache = _cache(num_pages, page_size, 3, 64, dtype, seed=tokens, layers=4)
    assert not k_cache.is_contiguous()
    table = torch.randperm(num_pages, generator=torch.Generator().manual_seed(prefix))[: -(-kv_len // page_size)]
    q = torch.randn(tokens, 9, 64, generator=torch.Generator().manual_seed(7)).to(dtype)
    got = ops.paged_extend_attention(q, k_cache, v_cache, table.int(), kv_len, 0.125)
    want = ops.paged_extend_attention(q, k_cache.contiguous(), v_cache.contiguous(), table.int(), kv_len, 0.125)
    assert torch.equal(got, want)


@pytest.mark.parametrize("tokens,prefix", [(40, 0), (17, 300)])
def test_extend_attention_fp16(ops, tokens, prefix):
    page_size, kv_len = 4, prefix + tokens
    num_pages = -(-kv_len // page_size)
    k_cache, v_cache = _cache(num_pages, page_size, 2, 128, torch.float16, seed=1)
    table = torch.randperm(num_pages, generator=torch.Generator().manual_seed(2)).int()
    q = torch.randn(tokens, 6, 128, generator=torch.Generator().manual_seed(3)).half()
    got = ops.paged_extend_attention(q, k_cache, v_cache, table, kv_len, 0.1)
    atol, rtol = EXTEND_TOL[torch.float16]
    torch.testing.assert_close(got.float(), _extend_reference(q, k_cache, v_cache, table, kv_len, 0.1),
                               atol=atol, rtol=rtol)


def test_extend_attention_is_the_same_on_any_thread_count(ops):
    """The kernels run an OpenMP team of torch's thread count; each row block is one thread's, so the
    split changes nothing, bit for bit (and a team of 3 on this machine's cores still finishes)."""
    k_cache, v_cache = _cache(40, 16, 3, 64, torch.float32, seed=4)
    table = torch.randperm(40, generator=torch.Generator().manual_seed(5)).int()
    q = torch.randn(400, 9, 64, generator=torch.Generator().manual_seed(6))
    threads = torch.get_num_threads()
    try:
        outs = []
        for n in (1, 3):
            torch.set_num_threads(n)
            outs.append(ops.paged_extend_attention(q, k_cache, v_cache, table, 600, 0.125))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(outs[0], outs[1])


def test_extend_attention_refuses_bad_input(ops):
    k_cache, v_cache = _cache(4, 4, 1, 64, torch.bfloat16, seed=0)
    q = torch.randn(3, 2, 64).bfloat16()
    ok = torch.tensor([0, 1], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="kv_len"):
        ops.paged_extend_attention(q, k_cache, v_cache, ok, 2, 1.0)     # fewer keys than tokens
    with pytest.raises(RuntimeError, match="kv_len"):
        ops.paged_extend_attention(q, k_cache, v_cache, ok, 9, 1.0)     # past the table
    with pytest.raises(RuntimeError, match="outside the cache"):
        ops.paged_extend_attention(q, k_cache, v_cache, torch.tensor([0, 7], dtype=torch.int32), 6, 1.0)
    with pytest.raises(RuntimeError, match="share a dtype"):
        ops.paged_extend_attention(q.float(), k_cache, v_cache, ok, 6, 1.0)
    with pytest.raises(RuntimeError, match="head dim"):
        ops.paged_extend_attention(q[..., :32], k_cache[..., :32].contiguous(), v_cache[..., :32].contiguous(),
                                   ok, 6, 1.0)
    with pytest.raises(RuntimeError, match="head dim"):
        ops.paged_extend_attention(q.double(), k_cache.double(), v_cache.double(), ok, 6, 1.0)
    assert not ops.extend_attention_supported(torch.bfloat16, 96)
    assert not ops.extend_attention_supported(torch.float64, 64)
    assert all(ops.extend_attention_supported(dt, d) for dt in (torch.float32, torch.bfloat16, torch.float16)
               for d in (64, 128))


def _engine(path, **kw) -> LLMEngine:
    cfg = dict(model=str(path), dtype="float32", kv_cache_gb=0.05, max_running_requests=8, page_size=4)
    return LLMEngine(EngineConfig(**{**cfg, **kw}))


@pytest.mark.parametrize("model", ["tiny_llama", "tiny_qwen2", "tiny_qwen3"])
def test_engine_with_kernels_gives_the_same_greedy_tokens(request, model):
    """Decode, chunked prefill (a later chunk over its own prefix), prefix-cache hits and mixed steps,
    in both KV layouts."""
    path = request.getfixturevalue(model)
    shared = random_prompts([40], 250, seed=3)[0]
    prompts = random_prompts([5, 17, 40, 3, 64, 9], 250, seed=11) + [shared + [7, 8], shared + [9]]
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    kw = dict(chunked_prefill_size=24)
    plain = _engine(path, enable_cpu_kernels=False, kv_layout="layer_first", **kw)
    want = [o.token_ids for o in plain.generate(prompts, params)]
    assert plain.runner.cpu_ops is None
    for kernels, layout in ((True, "page_first"), (True, "layer_first"), (False, "page_first")):
        engine = _engine(path, enable_cpu_kernels=kernels, kv_layout=layout, **kw)
        assert (engine.runner.attn.cpu_ops is not None) == kernels
        assert [o.token_ids for o in engine.generate(prompts, params)] == want, (kernels, layout)


def test_kernels_are_the_cpu_default_and_refused_with_graphs(tiny_llama):
    assert _engine(tiny_llama).runner.cpu_ops is not None
    assert _engine(tiny_llama, enable_graph=True, graph_bs=(1,)).runner.cpu_ops is None
    with pytest.raises(InvalidRequest, match="graphs"):
        _engine(tiny_llama, enable_graph=True, graph_bs=(1,), enable_cpu_kernels=True)


def _spy_extend(engine, calls: list) -> None:
    """Route `engine`'s attention kernels through a wrapper that records each extend call's kv_len."""
    ops = engine.runner.attn.cpu_ops

    class Spy:
        def __getattr__(self, name):
            fn = getattr(ops, name)
            return (lambda *a: calls.append(a[4]) or fn(*a)) if name == "paged_extend_attention" else fn

    engine.runner.attn.cpu_ops = Spy()


def test_engine_fp32_prefill_runs_the_extend_kernel(tmp_path):
    """A head dim the extend kernel takes (64, 6 query / 2 KV heads) in fp32: chunked prefill and prefix
    hits go through paged_extend_attention, with the same greedy tokens as the SDPA path."""
    from tests.fixtures.tiny_models import make_tiny_model

    path = make_tiny_model(tmp_path / "d64", "llama", hidden_size=96, head_dim=64, num_attention_heads=6,
                           num_key_value_heads=2)
    shared = random_prompts([60], 250, seed=3)[0]
    prompts = random_prompts([50, 90, 33], 250, seed=12) + [shared + [7] * 20, shared + [9] * 30]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    plain = _engine(path, enable_cpu_kernels=False, chunked_prefill_size=40)
    fused = _engine(path, enable_cpu_kernels=True, chunked_prefill_size=40)
    calls = []
    _spy_extend(fused, calls)
    a, b = plain.generate(prompts, params), fused.generate(prompts, params)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert calls and max(calls) > 40      # a chunk over its own cached prefix ran the kernel
    fused.check_idle()


def test_smollm2_bf16_prefill_runs_the_extend_kernel(smollm2_path):
    """bf16 SmolLM2 (head dim 64): a chunked prefill and a prefix-cache hit go through
    paged_extend_attention, and the last position's logits stay within bf16's band of the SDPA path's."""
    from tests.engine.test_bf16_parity import assert_logits_close

    def last_logits(engine, ids):
        model, outs = engine.runner.model, []
        forward = model.forward
        model.forward = lambda ctx: outs.append(forward(ctx)) or outs[-1]
        try:
            engine.generate([ids], SamplingParams(max_tokens=1, temperature=0))
        finally:
            model.forward = forward
        return [o for o in outs if o.shape[0]][-1][-1].float()

    cfg = dict(model=str(smollm2_path), dtype="bfloat16", max_total_tokens=4096, chunked_prefill_size=64)
    plain = LLMEngine(EngineConfig(**cfg, enable_cpu_kernels=False))
    fused = LLMEngine(EngineConfig(**cfg, enable_cpu_kernels=True))
    fused.runner.attn.extend_attention = "kernel"   # on AMX the default is torch's bf16 SDPA: test the kernel
    calls = []
    _spy_extend(fused, calls)
    prompt = random_prompts([150], fused.model_config.vocab_size, seed=5)[0]
    for ids in (prompt, prompt + [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30]):
        assert_logits_close(last_logits(fused, ids), last_logits(plain, ids))
    layers = fused.model_config.num_layers
    # 150 tokens in chunks of 64 (kv_len 64, 128, 150), then the 20 added ones over the cached prefix.
    assert sorted(set(calls)) == [64, 128, 150, 170] and len(calls) == 4 * layers
    fused.check_idle()
