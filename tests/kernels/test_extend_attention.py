"""Extend attention against the torch reference: new tokens over an empty prefix, a page-aligned
prefix, an odd prefix crossing pages, a long chunk (several query blocks), a sequence with no new
tokens; dtypes and GQA ratios; agreement with decode attention when every q_len is 1."""

from __future__ import annotations

import pytest
import torch

from tandem.kernels import reference
from tandem.kernels.decode_attention import paged_decode_attention
from tandem.kernels.extend_attention import extend_attention
from tests.kernels.helpers import DEVICE, DTYPES, assert_close, page_table, randn

PAGE_SIZE = 4
# (prefix_len, q_len) per sequence.
SEQS = [(0, 5), (4, 3), (7, 6), (3, 18), (9, 0)]


def make_case(dtype, group, seqs=SEQS, kv_heads=2, head_dim=16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    pages_each = -(-max(p + n for p, n in seqs) // PAGE_SIZE)
    num_pages = len(seqs) * pages_each + 2
    k_cache = randn(num_pages, PAGE_SIZE, kv_heads, head_dim, dtype=dtype, gen=gen)
    v_cache = randn(num_pages, PAGE_SIZE, kv_heads, head_dim, dtype=dtype, gen=gen)
    table = page_table(len(seqs), pages_each, num_pages, gen)
    q_lens = [n for _, n in seqs]
    prefix_lens = [p for p, _ in seqs]
    q = randn(sum(q_lens), kv_heads * group, head_dim, dtype=dtype, gen=gen)
    starts = [sum(q_lens[:i]) for i in range(len(seqs))]
    meta = [torch.tensor(x, dtype=torch.int32, device=DEVICE) for x in (starts, q_lens, prefix_lens)]
    return q, k_cache, v_cache, table, meta, q_lens, prefix_lens


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("group", [1, 3, 8])
def test_matches_reference(dtype, group):
    q, k_cache, v_cache, table, meta, q_lens, prefix_lens = make_case(dtype, group)
    scale = q.shape[-1] ** -0.5
    # Several query blocks per long sequence for every group size (block_q = block_m // pow2(group)).
    block_m = 16 if group == 1 else 32
    out = extend_attention(q, k_cache, v_cache, table, *meta, scale, block_m=block_m, block_n=16)
    expected = reference.extend_attention(q, k_cache, v_cache, table, q_lens, prefix_lens, scale)
    assert_close(out, expected, dtype)


def test_single_sequence_no_prefix_odd_head_dim():
    q, k_cache, v_cache, table, meta, q_lens, prefix_lens = make_case(
        torch.float32, group=2, seqs=[(0, 11)], head_dim=24, seed=1)
    out = extend_attention(q, k_cache, v_cache, table, *meta, 0.2, block_m=16, block_n=16)
    assert_close(out, reference.extend_attention(q, k_cache, v_cache, table, q_lens, prefix_lens, 0.2),
                 torch.float32)


def test_one_new_token_each_equals_decode():
    seqs = [(0, 1), (3, 1), (8, 1), (12, 1)]
    q, k_cache, v_cache, table, meta, _, _ = make_case(torch.float32, group=3, seqs=seqs, seed=2)
    kv_lens = torch.tensor([p + 1 for p, _ in seqs], dtype=torch.int32, device=DEVICE)
    ext = extend_attention(q, k_cache, v_cache, table, *meta, 0.25, block_n=16)
    dec = paged_decode_attention(q, k_cache, v_cache, table, kv_lens, 0.25, block_n=16)
    torch.testing.assert_close(ext, dec, atol=1e-6, rtol=1e-6)


def test_argument_checks():
    q, k_cache, v_cache, table, meta, _, _ = make_case(torch.float32, group=1)
    with pytest.raises(ValueError, match="one row per sequence"):
        extend_attention(q, k_cache, v_cache, table[:2], *meta, 1.0)
    with pytest.raises(ValueError, match="head_dim"):
        extend_attention(q[..., :8], k_cache, v_cache, table, *meta, 1.0)
    with pytest.raises(ValueError, match="block_m"):
        extend_attention(q, k_cache, v_cache, table, *meta, 1.0, block_m=24)
