"""KV store: write a step's new K/V rows into their slots of the paged pool.

Token t's K/V go to slot `slots[t] = page * page_size + offset` of one layer's cache
`[num_pages, page_size, KVH, D]`. A negative slot means "do not store" (padding rows of a fixed-size
batch). One program copies `BLOCK_T` tokens, each all KV heads at once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tandem.kernels.common import check, check_tensor, next_pow2


@triton.jit
def _store_kv_kernel(
    KNew, VNew, KCache, VCache, Slots, num_tokens,
    stride_knt, stride_knh, stride_vnt, stride_vnh,
    stride_kp, stride_kt, stride_kh,
    stride_vp, stride_vt, stride_vh,
    KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    t_mask = t < num_tokens
    slot = tl.load(Slots + t, mask=t_mask, other=-1).to(tl.int64)
    keep = t_mask & (slot >= 0)
    page = tl.where(keep, slot, 0) // PAGE_SIZE
    row = tl.where(keep, slot, 0) % PAGE_SIZE
    c = tl.arange(0, BLOCK_C)                      # flattened (head, dim) of one token
    h = c // HEAD_DIM
    d = c % HEAD_DIM
    mask = keep[:, None] & (c < KV_HEADS * HEAD_DIM)[None, :]
    k = tl.load(KNew + t[:, None] * stride_knt + (h * stride_knh + d)[None, :], mask=mask)
    v = tl.load(VNew + t[:, None] * stride_vnt + (h * stride_vnh + d)[None, :], mask=mask)
    tl.store(KCache + (page * stride_kp + row * stride_kt)[:, None] + (h * stride_kh + d)[None, :],
             k.to(KCache.dtype.element_ty), mask=mask)
    tl.store(VCache + (page * stride_vp + row * stride_vt)[:, None] + (h * stride_vh + d)[None, :],
             v.to(VCache.dtype.element_ty), mask=mask)


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slots: torch.Tensor) -> None:
    """k/v `[T, KVH, D]` -> `k_cache/v_cache[slot // page_size, slot % page_size]` for each token.

    Slots must be distinct (two tokens writing one slot race); negative slots are skipped.
    """
    check_tensor("k", k, 3)
    check_tensor("v", v, 3, device=k.device)
    check_tensor("k_cache", k_cache, 4, device=k.device)
    check_tensor("v_cache", v_cache, 4, device=k.device)
    check_tensor("slots", slots, 1, (torch.int32, torch.int64), k.device)
    num_tokens, kv_heads, head_dim = k.shape
    check(v.shape == k.shape, f"k {tuple(k.shape)} != v {tuple(v.shape)}")
    check(k_cache.shape == v_cache.shape and k_cache.dtype == v_cache.dtype,
          f"k_cache {tuple(k_cache.shape)} {k_cache.dtype} != v_cache {tuple(v_cache.shape)} {v_cache.dtype}")
    check(tuple(k_cache.shape[2:]) == (kv_heads, head_dim),
          f"new K/V heads/dim {(kv_heads, head_dim)} != cache {tuple(k_cache.shape[2:])}")
    page_size = k_cache.shape[1]
    check(page_size & (page_size - 1) == 0, f"page_size {page_size} must be a power of two")
    check(slots.shape[0] == num_tokens, f"slots has {slots.shape[0]} rows for {num_tokens} tokens")
    if num_tokens == 0:
        return
    block_c = next_pow2(kv_heads * head_dim)
    block_t = max(1, min(next_pow2(num_tokens), 4096 // block_c))
    _store_kv_kernel[(triton.cdiv(num_tokens, block_t),)](
        k, v, k_cache, v_cache, slots, num_tokens,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        KV_HEADS=kv_heads, HEAD_DIM=head_dim, PAGE_SIZE=page_size,
        BLOCK_T=block_t, BLOCK_C=block_c,
    )
