"""Rotary position embedding (Hugging Face's rotate-half layout) of q and k in one launch.

`out[..., :D/2] = x1 * cos - x2 * sin` and `out[..., D/2:] = x2 * cos + x1 * sin`, in fp32, with the
step's cos/sin rows `[T, D/2]` (`RotaryEmbedding.lookup` gathers them once per step). One program
per token rotates all its q and k heads. q/k may be strided views (e.g. slices of a fused qkv
projection); results go to new tensors, or back into q/k with `inplace=True`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tandem.kernels.common import check, check_tensor, next_pow2


@triton.jit
def _rotate_heads(X, Out, t, stride_t, stride_h, stride_ot, stride_oh, cos, sin, offs_j, j_mask,
                  NUM_HEADS: tl.constexpr, HALF: tl.constexpr, BLOCK_H: tl.constexpr):
    offs_h = tl.arange(0, BLOCK_H)
    mask = (offs_h < NUM_HEADS)[:, None] & j_mask[None, :]
    src = X + t * stride_t + offs_h[:, None] * stride_h + offs_j[None, :]
    x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
    dst = Out + t * stride_ot + offs_h[:, None] * stride_oh + offs_j[None, :]
    tl.store(dst, (x1 * cos[None, :] - x2 * sin[None, :]).to(Out.dtype.element_ty), mask=mask)
    tl.store(dst + HALF, (x2 * cos[None, :] + x1 * sin[None, :]).to(Out.dtype.element_ty), mask=mask)


@triton.jit
def _rope_kernel(
    Q, K, Cos, Sin, QOut, KOut,
    stride_qt, stride_qh, stride_kt, stride_kh,
    stride_qot, stride_qoh, stride_kot, stride_koh,
    stride_cos, stride_sin,
    NUM_Q_HEADS: tl.constexpr, NUM_K_HEADS: tl.constexpr, HALF: tl.constexpr,
    BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_J: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    offs_j = tl.arange(0, BLOCK_J)
    j_mask = offs_j < HALF
    cos = tl.load(Cos + t * stride_cos + offs_j, mask=j_mask, other=0.0).to(tl.float32)
    sin = tl.load(Sin + t * stride_sin + offs_j, mask=j_mask, other=0.0).to(tl.float32)
    _rotate_heads(Q, QOut, t, stride_qt, stride_qh, stride_qot, stride_qoh, cos, sin, offs_j, j_mask,
                  NUM_Q_HEADS, HALF, BLOCK_HQ)
    _rotate_heads(K, KOut, t, stride_kt, stride_kh, stride_kot, stride_koh, cos, sin, offs_j, j_mask,
                  NUM_K_HEADS, HALF, BLOCK_HK)


def apply_rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *,
               inplace: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """q `[T, H, D]`, k `[T, KVH, D]`, cos/sin `[T, D/2]` (any float dtype) -> rotated (q, k)."""
    check_tensor("q", q, 3)
    check_tensor("k", k, 3, device=q.device)
    check_tensor("cos", cos, 2, device=q.device)
    check_tensor("sin", sin, 2, device=q.device)
    num_tokens, num_q_heads, head_dim = q.shape
    check(head_dim % 2 == 0, f"head_dim {head_dim} must be even")
    check(k.shape[0] == num_tokens and k.shape[2] == head_dim,
          f"k {tuple(k.shape)} does not match q {tuple(q.shape)}")
    half = head_dim // 2
    check(tuple(cos.shape) == (num_tokens, half) and tuple(sin.shape) == (num_tokens, half),
          f"cos/sin must be [{num_tokens}, {half}], got {tuple(cos.shape)} / {tuple(sin.shape)}")
    q_out = q if inplace else torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_out = k if inplace else torch.empty(k.shape, dtype=k.dtype, device=k.device)
    if num_tokens:
        _rope_kernel[(num_tokens,)](
            q, k, cos, sin, q_out, k_out,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1),
            q_out.stride(0), q_out.stride(1), k_out.stride(0), k_out.stride(1),
            cos.stride(0), sin.stride(0),
            NUM_Q_HEADS=num_q_heads, NUM_K_HEADS=k.shape[1], HALF=half,
            BLOCK_HQ=next_pow2(num_q_heads), BLOCK_HK=next_pow2(k.shape[1]), BLOCK_J=next_pow2(half),
        )
    return q_out, k_out
