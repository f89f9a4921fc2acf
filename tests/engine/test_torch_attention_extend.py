"""engine/attention/torch_backend.py: the three ways a prefill/extend chunk's attention is computed (the
paged CPU kernel, SDPA upcast to fp32, SDPA in the pool's dtype: `extend_attention = "sdpa"`, the
default for bf16 on AMX) agree, with and without a cached prefix, next to decode rows."""

import pytest
import torch

from tandem.engine.attention.torch_backend import TorchAttention
from tandem.engine.forward_context import ForwardContext
from tandem.engine.kvcache.kv_pool import KVPool, KVPoolSpec
from tandem.kernels import cpu

HEADS, KV_HEADS, DIM, PAGE = 9, 3, 64, 16


def _run(path: str, ops, dtype, q_lens, prefix_lens, seed=0):
    spec = KVPoolSpec(1, 64, PAGE, KV_HEADS, DIM, dtype, "layer_first")
    pool = KVPool(spec)
    attn = TorchAttention(pool, HEADS, DIM)
    attn.cpu_ops, attn.extend_attention = ops, path
    g = torch.Generator().manual_seed(seed)
    kv_lens = [p + n for p, n in zip(prefix_lens, q_lens, strict=True)]
    pages_per = [-(-n // PAGE) for n in kv_lens]
    table = torch.zeros(len(q_lens), max(pages_per), dtype=torch.int32)
    first = 0
    for i, n in enumerate(pages_per):
        table[i, :n] = torch.arange(first, first + n, dtype=torch.int32)
        first += n
    # The cached prefixes' KV, written where the pages say.
    for i, p in enumerate(prefix_lens):
        if p:
            slots = torch.tensor([int(table[i, t // PAGE]) * PAGE + t % PAGE for t in range(p)])
            rows = pool.store_rows(slots)
            pool.store(0, torch.randn(p, KV_HEADS, DIM, generator=g).to(dtype),
                       torch.randn(p, KV_HEADS, DIM, generator=g).to(dtype), rows)
    out_slots = torch.tensor([int(table[i, t // PAGE]) * PAGE + t % PAGE
                              for i, (p, n) in enumerate(zip(prefix_lens, q_lens, strict=True)) for t in range(p, p + n)])
    total = sum(q_lens)
    ctx = ForwardContext(input_ids=torch.zeros(total, dtype=torch.int64), positions=torch.zeros(total, dtype=torch.int64),
                         out_slots=out_slots, logits_indices=torch.zeros(len(q_lens), dtype=torch.int64),
                         page_table=table, q_lens=q_lens, prefix_lens=prefix_lens, kv_lens=kv_lens,
                         is_decode=False, attn=attn)
    attn.prepare(ctx)
    q = torch.randn(total, HEADS, DIM, generator=g).to(dtype)
    k = torch.randn(total, KV_HEADS, DIM, generator=g).to(dtype)
    v = torch.randn(total, KV_HEADS, DIM, generator=g).to(dtype)
    return attn.forward(0, q, k, v, ctx).float()


@pytest.mark.parametrize("q_lens, prefix_lens", [
    ([256], [0]),                 # a whole prompt: causal SDPA, no gather
    ([96, 1, 1], [160, 40, 7]),   # a later chunk over a cached prefix, beside two decode rows
    ([33, 70], [0, 20]),
])
def test_extend_paths_agree(q_lens, prefix_lens):
    ops = cpu.load()
    fp32 = _run("kernel", None, torch.bfloat16, q_lens, prefix_lens)     # no kernels: SDPA upcast to fp32
    native = _run("sdpa", ops, torch.bfloat16, q_lens, prefix_lens)
    assert (native - fp32).abs().max() < 0.03                         # bf16 rounding of P.V
    if ops is not None and ops.extend_attention_supported(torch.bfloat16, DIM):
        kernel = _run("kernel", ops, torch.bfloat16, q_lens, prefix_lens)
        assert (kernel - fp32).abs().max() < 0.03
    exact = _run("sdpa", None, torch.float32, q_lens, prefix_lens)      # fp32 pool: "sdpa" keeps fp32
    assert torch.equal(exact, _run("kernel", None, torch.float32, q_lens, prefix_lens))
