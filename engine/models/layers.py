"""Small building blocks shared by the Llama-family decoders."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

# `kernels.rmsnorm.rms_norm` once the triton attention backend is created on CUDA; CUDA tensors
# then take the fused kernel (same numerics). CPU tensors always take the torch code below.
_fused_rms_norm: Callable | None = None


def use_fused_rms_norm(fn: Callable | None) -> None:
    global _fused_rms_norm
    _fused_rms_norm = fn


class RMSNorm(torch.nn.Module):
    """RMSNorm computed in fp32; the output is in the weight's (the model's) dtype.

    The input may be wider than the weight: the decoders keep their residual stream in fp32 (see
    `engine.models.llama`), and the normalised activations are rounded to the model dtype only
    where a matmul consumes them.
    """

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if _fused_rms_norm is not None and x.is_cuda:
            return _fused_rms_norm(x, self.weight, self.eps)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(self.weight.dtype)

    def forward_fp32(self, x: torch.Tensor) -> torch.Tensor:
        """The same norm with an fp32 result (for the logits, which are rescored in fp32)."""
        xf = x.float()
        return xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight.float()

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Fused-style `residual += x; return norm(residual), residual` (one place to swap in a kernel).

        The sum keeps the residual's dtype (fp32 in the decoders) whatever x's dtype is."""
        if _fused_rms_norm is not None and x.is_cuda:
            return _fused_rms_norm(x, self.weight, self.eps, residual)
        residual = residual + x
        return self.forward(residual), residual


class SiluAndMul(torch.nn.Module):
    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up
