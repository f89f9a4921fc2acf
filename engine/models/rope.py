"""Rotary position embeddings (Hugging Face's rotate-half layout), with Llama-3 frequency scaling."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from tandem.engine.models.config import RopeConfig

# `kernels.rope.apply_rope` once the triton attention backend is created on CUDA; CUDA tensors then
# take the fused kernel (same numerics). CPU tensors always take the torch code below.
_fused_rope: Callable | None = None


def use_fused_rope(fn: Callable | None) -> None:
    global _fused_rope
    _fused_rope = fn


def inv_frequencies(rope: RopeConfig, head_dim: int) -> torch.Tensor:
    inv_freq = 1.0 / (rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    if rope.rope_type == "linear":
        inv_freq = inv_freq / rope.factor
    elif rope.rope_type == "llama3":
        # Long wavelengths are slowed down by `factor`, short ones kept, and the band between is
        # interpolated smoothly (Llama 3.1's published recipe).
        old_ctx = rope.original_max_position_embeddings
        low_wavelen = old_ctx / rope.low_freq_factor
        high_wavelen = old_ctx / rope.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
        smooth = (old_ctx / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv_freq = torch.where(is_medium, smoothed, scaled)
    return inv_freq.float()


class RotaryEmbedding(torch.nn.Module):
    """Precomputed cos/sin tables indexed by absolute position; applied to q and k in place of copies."""

    def __init__(self, rope: RopeConfig, head_dim: int, max_positions: int):
        super().__init__()
        inv_freq = inv_frequencies(rope, head_dim)
        t = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)
        self.register_buffer("cos", freqs.cos(), persistent=False)  # [max_pos, head_dim / 2]
        self.register_buffer("sin", freqs.sin(), persistent=False)
        self.head_dim = head_dim

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin rows for a step's positions, `[T, 1, D/2]` each: looked up once, used by every layer."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)

    @staticmethod
    def apply(cos_sin: tuple[torch.Tensor, torch.Tensor], q: torch.Tensor, k: torch.Tensor,
              cpu_ops=None) -> tuple[torch.Tensor, torch.Tensor]:
        """q: [T, H, D], k: [T, KVH, D]; returns them rotated, in the input dtype. With `cpu_ops` (the
        fused CPU kernels, kernels.cpu) q and k are rotated in place (bit-identical to the torch code)."""
        cos, sin = cos_sin
        if _fused_rope is not None and q.is_cuda:
            return _fused_rope(q, k, cos.squeeze(1), sin.squeeze(1))
        if cpu_ops is not None and not q.is_cuda and not torch.compiler.is_compiling():
            cpu_ops.rope_(q, k, cos.squeeze(1), sin.squeeze(1))
            return q, k
        return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    xf = x.float()
    x1, x2 = xf[..., :half], xf[..., half:]
    out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    return out.to(x.dtype)
