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
        self.cpu_ops = None   # kernels.cpu's module when the fused CPU kernels are on (use_cpu_kernels)

    def _cpu_kernel(self, x: torch.Tensor) -> bool:
        return (self.cpu_ops is not None and x.dim() == 2 and x.dtype == self.weight.dtype and not x.is_cuda
                and not torch.compiler.is_compiling())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if _fused_rms_norm is not None and x.is_cuda:
            return _fused_rms_norm(x, self.weight, self.eps)
        if self._cpu_kernel(x):
            return self.cpu_ops.rms_norm(x.contiguous(), None, self.weight, self.eps)
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
        if self._cpu_kernel(x) and residual.dtype == torch.float32 and residual.is_contiguous():
            return self.cpu_ops.rms_norm(x.contiguous(), residual, self.weight, self.eps), residual  # residual += x
        residual = residual + x
        return self.forward(residual), residual


def use_cpu_kernels(model: torch.nn.Module, ops) -> int:
    """Route `model`'s norms and RoPE through the fused CPU kernels (`kernels.cpu`; None: the torch
    code). Per model, not global: two engines in one process may differ. Returns the modules set."""
    mods = [m for m in model.modules() if hasattr(m, "cpu_ops")]
    for m in mods:
        m.cpu_ops = ops
    return len(mods)


class SiluAndMul(torch.nn.Module):
    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up
