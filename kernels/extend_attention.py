"""Extend (prefill) attention over pages: a step's new tokens attend causally to themselves and to
the sequence's cached prefix (prefix-cache hits, earlier chunks of a chunked prefill).

The new tokens' K/V must already be in the pool (`kernels.kv_store.store_kv` runs first), so the
prefix and the new tokens are read the same way, through the page table: query `i` of sequence `b`
sits at absolute position `prefix_lens[b] + i` and sees every cached position `<=` it.

One program handles a block of `BLOCK_Q` queries of one sequence for all `H / KVH` query heads of
one KV head: the rows of its tiles are (query, head-in-group) pairs, so each K/V tile is loaded once
per group rather than once per head. fp32 online softmax; the loop stops at the block's last
query position (causal skip).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tandem.kernels.common import attention_tile, check, check_tensor, next_pow2, num_warps_for, upcast

_LOG2E = 1.4426950408889634


@triton.jit
def _extend_kernel(
    Q, K, V, PageTable, QStart, QLens, PrefixLens, Out,
    scale_log2,
    stride_qt, stride_qh,
    stride_kp, stride_kt, stride_kh,
    stride_vp, stride_vt, stride_vh,
    stride_pt,
    stride_ot, stride_oh,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, UPCAST: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    kvh = tl.program_id(1)
    qblk = tl.program_id(2)
    q_len = tl.load(QLens + b).to(tl.int32)
    prefix = tl.load(PrefixLens + b).to(tl.int32)
    q_start = tl.load(QStart + b).to(tl.int64)

    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    # Rows are (query, head-in-group) pairs: BLOCK_M = BLOCK_Q * BLOCK_G.
    qi = qblk * BLOCK_Q + offs_m // BLOCK_G        # query index within the sequence
    g = offs_m % BLOCK_G                           # head within the KV group
    m_mask = (qi < q_len) & (g < GROUP)
    d_mask = offs_d < HEAD_DIM
    heads = kvh * GROUP + g
    q_pos = prefix + qi
    tok = q_start + qi
    q = tl.load(Q + tok[:, None] * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
                mask=m_mask[:, None] & d_mask[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)

    # Keys up to the block's last valid query position; none for a block past the sequence's end.
    last_q = tl.minimum((qblk + 1) * BLOCK_Q, q_len)
    hi = tl.where(qblk * BLOCK_Q < q_len, prefix + last_q, 0)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for n0 in range(0, hi, BLOCK_N):
        pos = n0 + offs_n
        n_mask = pos < hi
        page = tl.load(PageTable + b * stride_pt + pos // PAGE_SIZE, mask=n_mask, other=0).to(tl.int64)
        row = pos % PAGE_SIZE
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k = tl.load(K + (page * stride_kp + row * stride_kt + kvh * stride_kh)[:, None] + offs_d[None, :],
                    mask=kv_mask, other=0.0)
        v = tl.load(V + (page * stride_vp + row * stride_vt + kvh * stride_vh)[:, None] + offs_d[None, :],
                    mask=kv_mask, other=0.0)
        if UPCAST:
            s = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        visible = n_mask[None, :] & (pos[None, :] <= q_pos[:, None])
        s = tl.where(visible, s * scale_log2, float("-inf"))
        # Position 0 is visible to every row in the first tile, so m_i is finite from then on.
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if UPCAST:
            pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(Out + tok[:, None] * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
             out.to(Out.dtype.element_ty), mask=m_mask[:, None] & d_mask[None, :])


def extend_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, page_table: torch.Tensor,
    q_start: torch.Tensor, q_lens: torch.Tensor, prefix_lens: torch.Tensor, scale: float, *,
    max_q_len: int | None = None, block_m: int | None = None, block_n: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of the flattened new tokens q `[T, H, D]` over their sequences' pages.

    Sequence b owns rows `q_start[b] : q_start[b] + q_lens[b]` of q (q_lens[b] may be 0) and had
    `prefix_lens[b]` tokens cached before this step; the pool must already hold the new tokens'
    K/V at positions `prefix_lens[b] + i`. `max_q_len` (a host int) sizes the grid without a sync.
    `block_m` (query x head rows per tile) and `block_n` (keys per tile) default to `attention_tile`.
    Returns `[T, H, D]` in q's dtype (rows no sequence owns are left untouched).
    """
    check_tensor("q", q, 3)
    check_tensor("k_cache", k_cache, 4, device=q.device)
    check_tensor("v_cache", v_cache, 4, device=q.device)
    check_tensor("page_table", page_table, 2, (torch.int32, torch.int64), q.device)
    for name, t in (("q_start", q_start), ("q_lens", q_lens), ("prefix_lens", prefix_lens)):
        check_tensor(name, t, 1, (torch.int32, torch.int64), q.device)
    num_tokens, num_heads, head_dim = q.shape
    _, page_size, kv_heads, cache_dim = k_cache.shape
    batch = q_lens.shape[0]
    check(k_cache.shape == v_cache.shape, f"k_cache {tuple(k_cache.shape)} != v_cache {tuple(v_cache.shape)}")
    check(k_cache.dtype == v_cache.dtype == q.dtype,
          f"q/k/v dtypes differ: {q.dtype} {k_cache.dtype} {v_cache.dtype}")
    check(cache_dim == head_dim, f"q head_dim {head_dim} != cache head_dim {cache_dim}")
    check(num_heads % kv_heads == 0, f"num_heads {num_heads} is not a multiple of kv_heads {kv_heads}")
    check(page_size & (page_size - 1) == 0, f"page_size {page_size} must be a power of two")
    check(page_table.shape[0] == batch and q_start.shape[0] == batch and prefix_lens.shape[0] == batch,
          "page_table, q_start, q_lens and prefix_lens must have one row per sequence")
    block_d = max(16, next_pow2(head_dim))
    block_m = block_m or attention_tile(block_d, q.dtype, q.device)
    block_n = block_n or attention_tile(block_d, q.dtype, q.device)
    for name, blk in (("block_m", block_m), ("block_n", block_n)):
        check(blk >= 16 and blk & (blk - 1) == 0, f"{name} {blk} must be a power of two >= 16")
    if out is None:
        out = torch.empty_like(q)
    else:
        check_tensor("out", out, 3, (q.dtype,), q.device)
        check(out.shape == q.shape, f"out {tuple(out.shape)} != q {tuple(q.shape)}")
    if batch == 0 or num_tokens == 0:
        return out
    if max_q_len is None:
        max_q_len = int(q_lens.max())
    if max_q_len == 0:
        return out

    group = num_heads // kv_heads
    block_g = next_pow2(group)
    block_q = max(1, block_m // block_g)
    grid = (batch, kv_heads, triton.cdiv(max_q_len, block_q))
    _extend_kernel[grid](
        q, k_cache, v_cache, page_table, q_start, q_lens, prefix_lens, out,
        scale * _LOG2E,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        page_table.stride(0),
        out.stride(0), out.stride(1),
        GROUP=group, HEAD_DIM=head_dim, PAGE_SIZE=page_size,
        BLOCK_Q=block_q, BLOCK_G=block_g, BLOCK_M=block_q * block_g, BLOCK_N=block_n, BLOCK_D=block_d,
        UPCAST=upcast(q.dtype, q.device),
        num_warps=num_warps_for(block_q * block_g * block_d),
    )
    return out
