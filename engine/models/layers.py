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
    """RMSNorm computed in fp32 and cast back, as the reference implementations do."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if _fused_rms_norm is not None and x.is_cuda:
            return _fused_rms_norm(x, self.weight, self.eps)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Fused-style `residual += x; return norm(residual), residual` (one place to swap in a kernel)."""
        if _fused_rms_norm is not None and x.is_cuda:
            return _fused_rms_norm(x, self.weight, self.eps, residual)
        residual = residual + x
        return self.forward(residual), residual


class SiluAndMul(torch.nn.Module):
    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up
