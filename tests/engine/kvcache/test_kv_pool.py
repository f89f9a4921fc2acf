"""The KV pool's two layouts: the same per-layer views, slots and tier blocks; page-first keeps a
page of every layer in one contiguous block."""

from __future__ import annotations

import pytest
import torch

from tandem.engine.kvcache.kv_pool import KVPool, KVPoolSpec

LAYOUTS = ("page_first", "layer_first")


def _pool(layout: str) -> KVPool:
    return KVPool(KVPoolSpec(num_layers=3, num_pages=5, page_size=4, kv_heads=2, head_dim=8, dtype=torch.float32,
                             kv_layout=layout))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_steps_store_lands_in_the_slots_each_layers_view_reads(layout):
    pool = _pool(layout)
    slots = torch.tensor([0, 5, 19, 7])
    rows = pool.store_rows(slots)
    assert rows.shape == (3, 2, 4)
    for layer in range(3):
        k = torch.randn(4, 2, 8)
        pool.store(layer, k, -k, rows)
        assert torch.equal(pool.k(layer)[pool.slot_index(slots)], k)
        assert torch.equal(pool.v(layer)[pool.slot_index(slots)], -k)
    assert (pool.buffer != 0).sum() == 3 * 2 * 4 * 2 * 8          # nothing else was written


@pytest.mark.parametrize("layout", LAYOUTS)
def test_slots_written_through_the_layer_views_read_back(layout):
    pool = _pool(layout)
    slots = torch.tensor([0, 5, 19, 7])
    for layer in range(3):
        k = torch.full((4, 2, 8), float(layer + 1))
        pool.k(layer)[pool.slot_index(slots)] = k
        pool.v(layer)[pool.slot_index(slots)] = -k
    for layer in range(3):
        assert pool.k(layer).shape == (5, 4, 2, 8)
        assert torch.equal(pool.k(layer)[pool.slot_index(slots)], torch.full((4, 2, 8), float(layer + 1)))
        assert torch.equal(pool.v(layer)[1, 1], torch.full((2, 8), -float(layer + 1)))    # slot 5
        assert pool.k(layer)[0, 1].abs().sum() == 0                                       # slot 1: untouched
    assert pool.buffer.abs().sum() == 4 * 2 * 8 * 2 * (1 + 2 + 3)


def test_page_first_keeps_a_page_of_every_layer_in_one_block():
    pool = _pool("page_first")
    pool.k(2)[pool.slot_index(torch.tensor([9]))] = 1.0         # page 2, offset 1, last layer's K
    flat = pool.buffer.view(5, -1)
    assert flat[2].abs().sum() > 0 and flat[[0, 1, 3, 4]].abs().sum() == 0
    assert pool.k(0).stride(0) == pool.block_bytes // 4


def test_tier_blocks_are_the_same_in_both_layouts():
    """A page packed from one layout unpacks into the other as the same KV (L2/L3 blocks do not
    depend on the pool's layout)."""
    src, dst = _pool("page_first"), _pool("layer_first")
    src.buffer.copy_(torch.randn(src.buffer.shape))
    dst.unpack_page(4, src.pack_page(1))
    for layer in range(3):
        assert torch.equal(dst.k(layer)[4], src.k(layer)[1]) and torch.equal(dst.v(layer)[4], src.v(layer)[1])
    assert bytes(dst.pack_page(4)) == bytes(src.pack_page(1))
