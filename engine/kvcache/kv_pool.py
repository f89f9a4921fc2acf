"""The paged KV cache: allocated once per worker, viewed by attention and by the transfer layer.

Layout: one tensor `buffer[num_layers, 2, num_pages, page_size, kv_heads, head_dim]` (index 0 of
the second axis is K, 1 is V). A page of one layer's K is one contiguous block of
`page_size * kv_heads * head_dim` elements, so a run of consecutive page ids is one contiguous
byte range per (layer, K|V): that is what the transfer layer merges and registers.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KVPoolSpec:
    num_layers: int
    num_pages: int
    page_size: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @property
    def page_bytes(self) -> int:
        """Bytes of one page of one layer's K (or V)."""
        return self.page_size * self.kv_heads * self.head_dim * torch.empty((), dtype=self.dtype).element_size()

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.num_layers, 2, self.num_pages, self.page_size, self.kv_heads, self.head_dim)

    @property
    def total_bytes(self) -> int:
        return self.page_bytes * self.num_pages * self.num_layers * 2


class KVPool:
    def __init__(self, spec: KVPoolSpec, device: torch.device | str = "cpu", buffer: torch.Tensor | None = None):
        """`buffer`, when given, is adopted as the storage (e.g. shared memory a transfer backend
        exposes); it must be zero-filled with shape `spec.shape` and dtype `spec.dtype`."""
        self.spec = spec
        if buffer is None:
            # Zero-filled: masked-out slots must never hold NaN/Inf garbage (0 * NaN poisons attention).
            buffer = torch.zeros(spec.shape, dtype=spec.dtype, device=device)
        assert tuple(buffer.shape) == spec.shape and buffer.dtype == spec.dtype and buffer.is_contiguous(), (
            f"KV buffer {tuple(buffer.shape)} {buffer.dtype} does not match {spec.shape} {spec.dtype}")
        self.buffer = buffer
        slots = spec.num_pages * spec.page_size
        self._k_flat = [self.buffer[i, 0].view(slots, spec.kv_heads, spec.head_dim) for i in range(spec.num_layers)]
        self._v_flat = [self.buffer[i, 1].view(slots, spec.kv_heads, spec.head_dim) for i in range(spec.num_layers)]

    def k(self, layer: int) -> torch.Tensor:
        """Layer's K as `[num_pages, page_size, kv_heads, head_dim]`."""
        return self.buffer[layer, 0]

    def v(self, layer: int) -> torch.Tensor:
        return self.buffer[layer, 1]

    def k_slots(self, layer: int) -> torch.Tensor:
        """Layer's K as `[num_pages * page_size, kv_heads, head_dim]`: row = page * page_size + offset."""
        return self._k_flat[layer]

    def v_slots(self, layer: int) -> torch.Tensor:
        return self._v_flat[layer]

    # --- one page as a block for the tiers below the pool (engine/kvcache/tiers/) ---------------
    @property
    def block_bytes(self) -> int:
        """Bytes of one page across every layer, K and V: a tier block."""
        return self.spec.page_bytes * self.spec.num_layers * 2

    def pack_page(self, page: int) -> memoryview:
        """Page `page` of every layer, K and V, as `[num_layers, 2, page_size, kv_heads, head_dim]`
        bytes in the pool's dtype (one gather copy; one device-to-host copy on a GPU)."""
        block = self.buffer[:, :, page].contiguous().view(torch.uint8)
        return memoryview(block.cpu().numpy()).cast("B")

    def unpack_page(self, page: int, payload: memoryview | bytes) -> None:
        """Write a `pack_page` block back into page `page`."""
        view = memoryview(payload).cast("B")
        assert view.nbytes == self.block_bytes, f"block of {view.nbytes} bytes, a page is {self.block_bytes}"
        with warnings.catch_warnings():
            # Read only (copied into the pool right away): a read-only buffer is fine.
            warnings.simplefilter("ignore", UserWarning)
            src = torch.frombuffer(view, dtype=torch.uint8)
        s = self.spec
        dst = self.buffer[:, :, page]
        dst.copy_(src.view(s.dtype).view(s.num_layers, 2, s.page_size, s.kv_heads, s.head_dim))
