"""The attention backend interface and its registry."""

from __future__ import annotations

import importlib.util
from abc import ABC, abstractmethod
from collections.abc import Callable

import torch

from tandem.engine.forward_context import ForwardContext
from tandem.engine.kvcache.kv_pool import KVPool


class AttentionBackend(ABC):
    """Writes a step's new K/V into the pool and attends over each sequence's pages.

    Lifecycle: constructed once per worker with the KV pool; `prepare(ctx)` once per step builds
    whatever metadata every layer shares; `forward` once per layer.
    """

    name: str = ""
    # Whether `graph_metadata` exists: a decode step can then be captured in a CUDA graph.
    supports_cuda_graph: bool = False

    def __init__(self, pool: KVPool, num_heads: int, head_dim: int, scale: float | None = None):
        self.pool = pool
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.scale = scale if scale is not None else head_dim ** -0.5

    @abstractmethod
    def prepare(self, ctx: ForwardContext) -> None:
        """Fill `ctx.attn_metadata`."""

    @abstractmethod
    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                ctx: ForwardContext) -> torch.Tensor:
        """q: [T, H, D], k/v: [T, KVH, D] (new tokens). Returns [T, H, D]."""


BACKENDS: dict[str, Callable[..., AttentionBackend]] = {}


def register_backend(name: str):
    def deco(cls):
        cls.name = name
        BACKENDS[name] = cls
        return cls
    return deco


def create_backend(name: str, pool: KVPool, num_heads: int, head_dim: int) -> AttentionBackend:
    # Importing a module registers its backend. The triton one is imported only when it is asked
    # for (or picked by `auto` on CUDA), so CPU runs never import triton.
    import tandem.engine.attention.torch_backend  # noqa: F401
    if name == "auto":
        name = "triton" if pool.buffer.is_cuda and importlib.util.find_spec("triton") is not None else "torch"
    if name == "triton":
        import tandem.engine.attention.triton_backend  # noqa: F401
    if name not in BACKENDS:
        known = sorted({*BACKENDS, "auto", "triton"})
        raise ValueError(f"unknown attention backend {name!r}; available: {known}")
    return BACKENDS[name](pool, num_heads, head_dim)
