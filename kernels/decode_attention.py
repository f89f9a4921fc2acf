"""Paged decode attention: one query token per sequence attends to all of its cached K/V pages.

Layout: q `[B, H, D]`; k_cache/v_cache one layer's pool view `[num_pages, page_size, KVH, D]`;
page_table `[B, max_pages]` (page ids, padding never read past `kv_lens[b]`); kv_lens `[B]`.

One program handles one (sequence, KV head, split): it loads each K/V tile once for all `H / KVH`
query heads of the group (the heads are the rows of a `tl.dot`, padded to 16 for the tensor
cores), and runs an fp32 online softmax over its share of the context. With more than one split
(split-K, for long contexts and small batches that would leave SMs idle) each split writes a
normalised partial output and its log-sum-exp, and a second kernel merges them; with one split the
first kernel writes the output directly.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tandem.kernels.common import (
    attention_tile,
    check,
    check_tensor,
    is_interpreted,
    next_pow2,
    num_warps_for,
    upcast,
)

_LOG2E = 1.4426950408889634


@triton.jit
def _decode_split_kernel(
    Q, K, V, PageTable, KVLens, Out, PartO, PartLSE,
    scale_log2,
    stride_qb, stride_qh,
    stride_kp, stride_kt, stride_kh,
    stride_vp, stride_vt, stride_vh,
    stride_pt,
    stride_ob, stride_oh,
    tokens_per_split, num_splits,
    NUM_HEADS: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    UPCAST: tl.constexpr, DIRECT: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    kv_len = tl.load(KVLens + b).to(tl.int32)
    start = split * tokens_per_split
    end = tl.minimum(start + tokens_per_split, kv_len)

    offs_h = tl.arange(0, BLOCK_H)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    h_mask = offs_h < GROUP
    d_mask = offs_d < HEAD_DIM
    heads = kvh * GROUP + offs_h
    q = tl.load(Q + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                mask=h_mask[:, None] & d_mask[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        pos = n0 + offs_n
        n_mask = pos < end
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
        # Every tile of the loop holds at least one valid position, so m_new is finite.
        s = tl.where(n_mask[None, :], s * scale_log2, float("-inf"))
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

    nonempty = l_i > 0
    l_safe = tl.where(nonempty, l_i, 1.0)
    out = acc / l_safe[:, None]
    o_mask = h_mask[:, None] & d_mask[None, :]
    if DIRECT:
        tl.store(Out + b * stride_ob + heads[:, None] * stride_oh + offs_d[None, :],
                 out.to(Out.dtype.element_ty), mask=o_mask)
    else:
        part = (b * NUM_HEADS + heads) * num_splits + split          # row of [B, H, S]
        tl.store(PartLSE + part, tl.where(nonempty, m_i + tl.log2(l_safe), float("-inf")), mask=h_mask)
        tl.store(PartO + part[:, None] * HEAD_DIM + offs_d[None, :], out, mask=o_mask)


@triton.jit
def _decode_merge_kernel(
    PartO, PartLSE, Out, stride_ob, stride_oh, num_splits,
    NUM_HEADS: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
):
    # One program merges the splits of one (sequence, KV head group): tiles [heads, splits, dim].
    b = tl.program_id(0).to(tl.int64)
    kvh = tl.program_id(1)
    offs_h = tl.arange(0, BLOCK_H)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    h_mask = offs_h < GROUP
    d_mask = offs_d < HEAD_DIM
    hs_mask = h_mask[:, None] & (offs_s < num_splits)[None, :]
    heads = kvh * GROUP + offs_h
    rows = (b * NUM_HEADS + heads)[:, None] * num_splits + offs_s[None, :]      # [BLOCK_H, BLOCK_S]
    lse = tl.load(PartLSE + rows, mask=hs_mask, other=float("-inf"))
    live = lse > float("-inf")
    m = tl.max(tl.where(live, lse, -1e30), 1)
    w = tl.where(live, tl.exp2(tl.where(live, lse, m[:, None]) - m[:, None]), 0.0)  # empty splits weigh 0
    o = tl.load(PartO + rows[:, :, None] * HEAD_DIM + offs_d[None, None, :],
                mask=hs_mask[:, :, None] & d_mask[None, None, :], other=0.0)
    denom = tl.sum(w, 1)
    res = tl.sum(w[:, :, None] * o, 1) / tl.where(denom > 0, denom, 1.0)[:, None]
    tl.store(Out + b * stride_ob + heads[:, None] * stride_oh + offs_d[None, :],
             res.to(Out.dtype.element_ty), mask=h_mask[:, None] & d_mask[None, :])


def runs_in_interpreter() -> bool:
    """True when these kernels were built for the CPU interpreter (TRITON_INTERPRET=1 at import)."""
    return is_interpreted(_decode_split_kernel)


def default_num_splits(batch: int, kv_heads: int, max_kv_len: int, device: torch.device) -> int:
    """Splits per (sequence, KV head) so the GPU sees >= 8 programs per SM (a few resident at a
    time, so the last wave is a small fraction of the work), each with >= 256 tokens.

    On CPU (the interpreter runs programs one after another) one split per 4096 tokens.
    """
    if device.type != "cuda":
        return max(1, triton.cdiv(max_kv_len, 4096))
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    want = triton.cdiv(8 * sms, max(1, batch * kv_heads))
    return max(1, min(want, triton.cdiv(max_kv_len, 256), 64))


def paged_decode_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, page_table: torch.Tensor,
    kv_lens: torch.Tensor, scale: float, *, max_kv_len: int | None = None,
    num_splits: int | None = None, block_n: int | None = None, out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of q `[B, H, D]` over each sequence's first `kv_lens[b]` cached tokens -> `[B, H, D]`.

    `max_kv_len` (a host int, >= max(kv_lens)) sizes the splits; pass it to avoid a device sync.
    `num_splits` defaults to `default_num_splits`, `block_n` (keys per tile) to `attention_tile`.
    Every kv_lens[b] must be >= 1.
    """
    check_tensor("q", q, 3)
    check_tensor("k_cache", k_cache, 4, device=q.device)
    check_tensor("v_cache", v_cache, 4, device=q.device)
    check_tensor("page_table", page_table, 2, (torch.int32, torch.int64), q.device)
    check_tensor("kv_lens", kv_lens, 1, (torch.int32, torch.int64), q.device)
    batch, num_heads, head_dim = q.shape
    _, page_size, kv_heads, cache_dim = k_cache.shape
    check(k_cache.shape == v_cache.shape, f"k_cache {tuple(k_cache.shape)} != v_cache {tuple(v_cache.shape)}")
    check(k_cache.dtype == v_cache.dtype == q.dtype,
          f"q/k/v dtypes differ: {q.dtype} {k_cache.dtype} {v_cache.dtype}")
    check(cache_dim == head_dim, f"q head_dim {head_dim} != cache head_dim {cache_dim}")
    check(num_heads % kv_heads == 0, f"num_heads {num_heads} is not a multiple of kv_heads {kv_heads}")
    check(page_size & (page_size - 1) == 0, f"page_size {page_size} must be a power of two")
    check(page_table.shape[0] == batch and kv_lens.shape[0] == batch,
          f"page_table {tuple(page_table.shape)} / kv_lens {tuple(kv_lens.shape)} do not match batch {batch}")
    block_d = max(16, next_pow2(head_dim))
    block_n = block_n or attention_tile(block_d, q.dtype, q.device)
    check(block_n >= 16 and block_n & (block_n - 1) == 0, f"block_n {block_n} must be a power of two >= 16")
    if out is None:
        out = torch.empty_like(q)
    else:
        check_tensor("out", out, 3, (q.dtype,), q.device)
        check(out.shape == q.shape, f"out {tuple(out.shape)} != q {tuple(q.shape)}")
    if batch == 0:
        return out
    if max_kv_len is None:
        max_kv_len = int(kv_lens.max())
    check(max_kv_len >= 1, "every sequence needs at least one cached token")
    if num_splits is None:
        num_splits = default_num_splits(batch, kv_heads, max_kv_len, q.device)
    per_split = triton.cdiv(max_kv_len, max(1, num_splits))
    tokens_per_split = triton.cdiv(per_split, block_n) * block_n
    num_splits = triton.cdiv(max_kv_len, tokens_per_split)

    group = num_heads // kv_heads
    block_h = max(16, next_pow2(group))
    direct = num_splits == 1
    if direct:
        part_o = part_lse = out  # unused
    else:
        part_o = torch.empty((batch, num_heads, num_splits, head_dim), dtype=torch.float32, device=q.device)
        part_lse = torch.empty((batch, num_heads, num_splits), dtype=torch.float32, device=q.device)
    _decode_split_kernel[(batch, kv_heads, num_splits)](
        q, k_cache, v_cache, page_table, kv_lens, out, part_o, part_lse,
        scale * _LOG2E,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        page_table.stride(0),
        out.stride(0), out.stride(1),
        tokens_per_split, num_splits,
        NUM_HEADS=num_heads, GROUP=group, HEAD_DIM=head_dim, PAGE_SIZE=page_size,
        BLOCK_H=block_h, BLOCK_N=block_n, BLOCK_D=block_d,
        UPCAST=upcast(q.dtype, q.device), DIRECT=direct,
        num_warps=num_warps_for(block_n * block_d),
    )
    if not direct:
        _decode_merge_kernel[(batch, kv_heads)](
            part_o, part_lse, out, out.stride(0), out.stride(1), num_splits,
            NUM_HEADS=num_heads, GROUP=group, HEAD_DIM=head_dim,
            BLOCK_H=next_pow2(group), BLOCK_S=next_pow2(num_splits), BLOCK_D=block_d,
        )
    return out
