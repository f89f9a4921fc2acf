"""Fused RMSNorm, optionally with the residual add: `residual += x; y = norm(residual) * weight`.

Numerics follow `engine.models.layers.RMSNorm`: the sum `residual + x` is kept in the residual's
dtype (fp32 in the decoders, whatever x's dtype), the normalisation runs in fp32 and is rounded to
the weight's dtype (the model dtype) before the weight multiplies it. One program per row.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tandem.kernels.common import check, check_tensor, next_pow2, num_warps_for


@triton.jit
def _rms_norm_kernel(
    X, Res, W, Out, ResOut,
    stride_x, stride_r, stride_o, stride_ro,
    n_cols, eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK_N: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    mask = cols < n_cols
    x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(Res + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
        s = (x + r).to(ResOut.dtype.element_ty)
        tl.store(ResOut + row * stride_ro + cols, s, mask=mask)
        x = s.to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(x * x, 0) / n_cols + eps)
    y = (x * inv_rms).to(Out.dtype.element_ty).to(tl.float32)
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(Out + row * stride_o + cols, (y * w).to(Out.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """RMSNorm over the last dim of x `[..., N]` with weight `[N]`.

    Without `residual`, returns `y`; with it (same shape as x), returns `(y, x + residual)`, the
    second being what the next block adds to. Inputs are not modified.
    """
    check_tensor("x", x, x.dim())
    check_tensor("weight", weight, 1, device=x.device)
    check(x.dim() >= 1 and x.shape[-1] == weight.shape[0],
          f"x {tuple(x.shape)} does not end in weight's size {weight.shape[0]}")
    n = x.shape[-1]
    x2 = x.reshape(-1, n)
    if residual is not None:
        check_tensor("residual", residual, x.dim(), device=x.device)
        check(residual.shape == x.shape, f"residual {tuple(residual.shape)} != x {tuple(x.shape)}")
        r2 = residual.reshape(-1, n)
        sum_dtype = torch.promote_types(x.dtype, residual.dtype)
    else:
        r2 = x2
        sum_dtype = x.dtype
    out = torch.empty(x2.shape, dtype=weight.dtype, device=x.device)
    res_out = torch.empty(x2.shape, dtype=sum_dtype, device=x.device) if residual is not None else x2
    rows = x2.shape[0]
    if rows:
        block = next_pow2(n)
        _rms_norm_kernel[(rows,)](
            x2, r2, weight, out, res_out,
            x2.stride(0), r2.stride(0), out.stride(0), res_out.stride(0),
            n, eps,
            HAS_RESIDUAL=residual is not None, BLOCK_N=block, num_warps=num_warps_for(block),
        )
    out = out.view(x.shape)
    return out if residual is None else (out, res_out.view(x.shape))
