"""KV pack/unpack: the staging buffer equals the reference gather in both layouts, and unpacking
restores the pages bit for bit (for a slice of the layers too)."""

from __future__ import annotations

import pytest
import torch

from tandem.kernels import reference
from tandem.kernels.kv_pack import pack_kv_pages, staging_shape, unpack_kv_pages
from tests.kernels.helpers import DEVICE, randn


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_round_trip(dtype, layout):
    gen = torch.Generator().manual_seed(0)
    layers, num_pages, page_size, kv_heads, head_dim = 2, 10, 4, 3, 12
    pool = randn(layers, 2, num_pages, page_size, kv_heads, head_dim, dtype=dtype, gen=gen)
    pages = torch.tensor([7, 2, 3, 9], device=DEVICE)
    staged = pack_kv_pages(pool, pages, layout=layout)
    assert staged.shape == staging_shape(pool, 4, layout) and staged.is_contiguous()
    assert torch.equal(staged, reference.pack_kv_pages(pool, pages, layout))

    dst = torch.zeros_like(pool)
    dst_pages = torch.tensor([0, 5, 1, 8], dtype=torch.int32, device=DEVICE)
    unpack_kv_pages(staged, dst, dst_pages, layout=layout)
    expected = torch.zeros_like(pool)
    reference.unpack_kv_pages(staged, expected, dst_pages, layout)
    assert torch.equal(dst, expected)
    assert torch.equal(dst[:, :, dst_pages.long()], pool[:, :, pages])


def test_layer_slice_and_preallocated_out():
    gen = torch.Generator().manual_seed(1)
    pool = randn(3, 2, 6, 2, 1, 16, dtype=torch.float16, gen=gen)
    pages = torch.tensor([4, 1], device=DEVICE)
    out = torch.empty(staging_shape(pool[1:], 2), dtype=pool.dtype, device=DEVICE)
    assert pack_kv_pages(pool[1:], pages, out=out) is out
    assert torch.equal(out, pool[1:, :, pages])
    with pytest.raises(ValueError, match="layout"):
        pack_kv_pages(pool, pages, layout="HDN")
    with pytest.raises(ValueError, match="staging must be"):
        unpack_kv_pages(out, pool, pages)
