"""Paged decode attention against the torch reference: dtypes, GQA ratios, odd lengths, page
boundaries, split-K (including splits that get no tokens), strided inputs, argument checks."""

from __future__ import annotations

import pytest
import torch

from tandem.kernels import reference
from tandem.kernels.decode_attention import paged_decode_attention
from tests.kernels.helpers import DEVICE, DTYPES, assert_close, page_table, randn

PAGE_SIZE = 4
# 1 token; exactly one page; odd and crossing pages; long enough for three 16-token splits.
KV_LENS = [1, 4, 13, 37]


def make_case(dtype, group, kv_heads=2, head_dim=16, kv_lens=KV_LENS, seed=0):
    gen = torch.Generator().manual_seed(seed)
    pages_each = -(-max(kv_lens) // PAGE_SIZE)
    num_pages = len(kv_lens) * pages_each + 3
    k_cache = randn(num_pages, PAGE_SIZE, kv_heads, head_dim, dtype=dtype, gen=gen)
    v_cache = randn(num_pages, PAGE_SIZE, kv_heads, head_dim, dtype=dtype, gen=gen)
    table = page_table(len(kv_lens), pages_each, num_pages, gen)
    q = randn(len(kv_lens), kv_heads * group, head_dim, dtype=dtype, gen=gen)
    lens = torch.tensor(kv_lens, dtype=torch.int32, device=DEVICE)
    return q, k_cache, v_cache, table, lens


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("group,num_splits", [(1, 3), (3, 1), (8, 3)])
def test_matches_reference(dtype, group, num_splits):
    # num_splits 1: the split kernel writes the output; 3: partials merged by the second kernel,
    # with empty splits for the short sequences.
    q, k_cache, v_cache, table, lens = make_case(dtype, group)
    scale = q.shape[-1] ** -0.5
    out = paged_decode_attention(q, k_cache, v_cache, table, lens, scale,
                                 max_kv_len=max(KV_LENS), num_splits=num_splits, block_n=16)
    assert_close(out, reference.decode_attention(q, k_cache, v_cache, table, KV_LENS, scale), dtype)


def test_odd_head_dim_and_strided_inputs():
    # head_dim 24 (tiles padded to 32); q a strided slice of a fused projection; out a strided view.
    dtype = torch.float32
    _, k_cache, v_cache, table, lens = make_case(dtype, group=2, head_dim=24, seed=1)
    gen = torch.Generator().manual_seed(2)
    fused = randn(len(KV_LENS), 4 * 24 + 10, dtype=dtype, gen=gen)
    q = fused[:, 10:].view(len(KV_LENS), 4, 24)
    out_buf = torch.zeros(len(KV_LENS), 4, 32, dtype=dtype, device=DEVICE)
    out = paged_decode_attention(q, k_cache, v_cache, table, lens, 0.3, num_splits=2, block_n=16,
                                 out=out_buf[..., :24])
    assert out.data_ptr() == out_buf.data_ptr()
    assert_close(out, reference.decode_attention(q, k_cache, v_cache, table, KV_LENS, 0.3), dtype)
    assert not out_buf[..., 24:].any()


def test_split_count_does_not_change_result():
    q, k_cache, v_cache, table, lens = make_case(torch.float32, group=3, seed=3)
    one = paged_decode_attention(q, k_cache, v_cache, table, lens, 0.25, num_splits=1, block_n=16)
    many = paged_decode_attention(q, k_cache, v_cache, table, lens, 0.25, num_splits=4, block_n=16)
    torch.testing.assert_close(one, many, atol=1e-6, rtol=1e-6)


def test_argument_checks():
    q, k_cache, v_cache, table, lens = make_case(torch.float32, group=1)
    with pytest.raises(ValueError, match="dtypes differ"):
        paged_decode_attention(q.half(), k_cache, v_cache, table, lens, 1.0)
    with pytest.raises(ValueError, match="multiple of kv_heads"):
        paged_decode_attention(q[:, :1], k_cache, v_cache, table, lens, 1.0)
    with pytest.raises(ValueError, match="unit stride"):
        q_strided = q.transpose(1, 2).contiguous().transpose(1, 2)
        paged_decode_attention(q_strided, k_cache, v_cache, table, lens, 1.0)
    with pytest.raises(ValueError, match="page_table"):
        paged_decode_attention(q, k_cache, v_cache, table.float(), lens, 1.0)
    with pytest.raises(ValueError, match="batch"):
        paged_decode_attention(q, k_cache, v_cache, table[:2], lens, 1.0)
