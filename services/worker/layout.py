"""The transfer layer's view of a worker's KV pool (kvtransfer does not import the engine)."""

from __future__ import annotations

from tandem.engine.kvcache.kv_pool import KVPoolSpec
from tandem.kvtransfer.base import PoolLayout


def layout_of(spec: KVPoolSpec) -> PoolLayout:
    return PoolLayout(spec.num_layers, spec.num_pages, spec.page_size, spec.kv_heads, spec.head_dim,
                      str(spec.dtype).removeprefix("torch."), spec.kv_layout)
