"""The paged KV cache: allocated once per worker, viewed by attention and by the transfer layer.

Two layouts of one tensor (`--kv-layout`); in both, a page of one layer's K (or V) is one contiguous
block of `page_size * kv_heads * head_dim` elements, which is all attention needs (it takes each
layer's K and V as `[num_pages, page_size, kv_heads, head_dim]` views with a page stride):

- `page_first` (default): `buffer[num_pages, num_layers, 2, page_size, kv_heads, head_dim]`. A page
  of every layer, K and V, is one contiguous block: one piece for the transfer layer and the tiers,
  and a run of consecutive page ids is one byte range.
- `layer_first`: `buffer[num_layers, 2, num_pages, page_size, kv_heads, head_dim]`. A run of
  consecutive page ids is one byte range per (layer, K|V): 2 * num_layers pieces per page.

Index 0 of the K|V axis is K, 1 is V.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch

from tandem.engine.config import KV_LAYOUTS


@dataclass(frozen=True)
class KVPoolSpec:
    num_layers: int
    num_pages: int
    page_size: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype
    kv_layout: str = "page_first"

    def __post_init__(self):
        assert self.kv_layout in KV_LAYOUTS, self.kv_layout

    @property
    def page_bytes(self) -> int:
        """Bytes of one page of one layer's K (or V)."""
        return self.page_size * self.kv_heads * self.head_dim * torch.empty((), dtype=self.dtype).element_size()

    @property
    def shape(self) -> tuple[int, ...]:
        page = (self.page_size, self.kv_heads, self.head_dim)
        if self.kv_layout == "page_first":
            return (self.num_pages, self.num_layers, 2, *page)
        return (self.num_layers, 2, self.num_pages, *page)

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
        self._rows = buffer.view(-1, spec.kv_heads * spec.head_dim)
        # Each layer's K and V as `[num_pages, page_size, kv_heads, head_dim]` views (page-first: pages
        # num_layers * 2 blocks apart); every page's slots contiguous.
        if spec.kv_layout == "page_first":
            self._k = [buffer[:, i, 0] for i in range(spec.num_layers)]
            self._v = [buffer[:, i, 1] for i in range(spec.num_layers)]
        else:
            self._k = [buffer[i, 0] for i in range(spec.num_layers)]
            self._v = [buffer[i, 1] for i in range(spec.num_layers)]

    def k(self, layer: int) -> torch.Tensor:
        """Layer's K as `[num_pages, page_size, kv_heads, head_dim]` (a view; pages may be strided)."""
        return self._k[layer]

    def v(self, layer: int) -> torch.Tensor:
        return self._v[layer]

    def slot_index(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Slots (`page * page_size + offset`) as the (page, offset) index of `k(layer)` / `v(layer)`:
        `pool.k(layer)[pool.slot_index(slots)]` reads or writes those slots in either layout."""
        return slots // self.spec.page_size, slots % self.spec.page_size

    def store_rows(self, slots: torch.Tensor) -> torch.Tensor:
        """`[num_layers, 2, T]`: the rows of the pool seen as `[rows, kv_heads * head_dim]` (one row per
        token, layer and K|V) that `slots`' K (`[:, 0]`) and V (`[:, 1]`) go to. Built once per step, so
        each layer's store is one single-index write, whatever the layout."""
        s = self.spec
        ps, layers = s.page_size, s.num_layers
        if s.kv_layout == "page_first":
            per_page, per_layer, per_kv = 2 * layers * ps, 2 * ps, ps
        else:
            per_page, per_layer, per_kv = ps, 2 * s.num_pages * ps, s.num_pages * ps
        base = (slots // ps) * per_page + slots % ps
        layer = torch.arange(layers, device=slots.device) * per_layer
        kv = torch.arange(2, device=slots.device) * per_kv
        return base[None, None, :] + layer[:, None, None] + kv[None, :, None]

    def store(self, layer: int, k: torch.Tensor, v: torch.Tensor, rows: torch.Tensor) -> None:
        """Write a step's new K and V `[T, kv_heads, head_dim]` of `layer` at `rows` (`store_rows`)."""
        self._rows[rows[layer, 0]] = k.reshape(k.shape[0], -1)
        self._rows[rows[layer, 1]] = v.reshape(v.shape[0], -1)

    def _page(self, page: int) -> torch.Tensor:
        """Page `page` of every layer, K and V, as `[num_layers, 2, page_size, kv_heads, head_dim]`."""
        return self.buffer[page] if self.spec.kv_layout == "page_first" else self.buffer[:, :, page]

    # --- one page as a block for the tiers below the pool (engine/kvcache/tiers/) ---------------
    @property
    def block_bytes(self) -> int:
        """Bytes of one page across every layer, K and V: a tier block."""
        return self.spec.page_bytes * self.spec.num_layers * 2

    def pack_page(self, page: int) -> memoryview:
        """Page `page` of every layer, K and V, as `[num_layers, 2, page_size, kv_heads, head_dim]`
        bytes in the pool's dtype (one gather copy; one device-to-host copy on a GPU)."""
        block = self._page(page).contiguous().view(torch.uint8)
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
        dst = self._page(page)
        dst.copy_(src.view(s.dtype).view(s.num_layers, 2, s.page_size, s.kv_heads, s.head_dim))

