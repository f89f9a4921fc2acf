"""KV pack/unpack: the staging buffer equals the reference gather in both staging layouts and from both
pool layouts (layer-first and page-first), unpacking restores the pages bit for bit (for a slice of
the layers too), and the two pool layouts of the same KV stage the same bytes."""

from __future__ import annotations

import pytest
import torch

from tandem.kernels import reference
from tandem.kernels.kv_pack import pack_kv_pages, staging_shape, unpack_kv_pages
from tests.kernels.helpers import DEVICE, randn

KV_LAYOUTS = ["layer_first", "page_first"]


def make_pool(layers: int, num_pages: int, page: tuple[int, int, int], kv_layout: str, dtype, gen) -> torch.Tensor:
    """A contiguous pool in `kv_layout` holding random KV."""
    by_layer = randn(layers, 2, num_pages, *page, dtype=dtype, gen=gen)
    return by_layer.movedim(2, 0).contiguous() if kv_layout == "page_first" else by_layer


def pages_of(pool: torch.Tensor, ids: torch.Tensor, kv_layout: str) -> torch.Tensor:
    """Pages `ids` of every layer, K and V, as `[L, 2, n, ...]`."""
    return pool[ids].movedim(0, 2) if kv_layout == "page_first" else pool[:, :, ids]


@pytest.mark.parametrize("kv_layout", KV_LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_round_trip(dtype, layout, kv_layout):
    gen = torch.Generator().manual_seed(0)
    pool = make_pool(2, 10, (4, 3, 12), kv_layout, dtype, gen)
    pages = torch.tensor([7, 2, 3, 9], device=DEVICE)
    staged = pack_kv_pages(pool, pages, kv_layout=kv_layout, layout=layout)
    assert staged.shape == staging_shape(pool, 4, layout, kv_layout=kv_layout) and staged.is_contiguous()
    assert staged.shape[:3] == (2, 2, 4)
    assert torch.equal(staged, reference.pack_kv_pages(pool, pages, layout, kv_layout))

    dst = torch.zeros_like(pool)
    dst_pages = torch.tensor([0, 5, 1, 8], dtype=torch.int32, device=DEVICE)
    unpack_kv_pages(staged, dst, dst_pages, kv_layout=kv_layout, layout=layout)
    expected = torch.zeros_like(pool)
    reference.unpack_kv_pages(staged, expected, dst_pages, layout, kv_layout)
    assert torch.equal(dst, expected)
    assert torch.equal(pages_of(dst, dst_pages.long(), kv_layout), pages_of(pool, pages, kv_layout))
    untouched = [p for p in range(10) if p not in dst_pages.tolist()]
    assert not pages_of(dst, torch.tensor(untouched, device=DEVICE), kv_layout).any()


def test_both_pool_layouts_stage_the_same_bytes():
    """A page-first worker and a layer-first one exchange staging buffers: one KV, one staged form."""
    gen = torch.Generator().manual_seed(2)
    layer_first = make_pool(3, 7, (2, 2, 8), "layer_first", torch.float16, gen)
    page_first = layer_first.movedim(2, 0).contiguous()
    pages = torch.tensor([6, 0, 4], device=DEVICE)
    for layout in ("NHD", "HND"):
        staged = pack_kv_pages(layer_first, pages, kv_layout="layer_first", layout=layout)
        assert torch.equal(pack_kv_pages(page_first, pages, kv_layout="page_first", layout=layout), staged)
        back = torch.zeros_like(page_first)
        unpack_kv_pages(staged, back, pages, kv_layout="page_first", layout=layout)
        assert torch.equal(back[pages], page_first[pages])


@pytest.mark.parametrize("kv_layout", KV_LAYOUTS)
def test_layer_slice_and_preallocated_out(kv_layout):
    gen = torch.Generator().manual_seed(1)
    pool = make_pool(3, 6, (2, 1, 16), kv_layout, torch.float16, gen)
    layers = pool[:, 1:] if kv_layout == "page_first" else pool[1:]     # layers 1 and 2: strided views
    pages = torch.tensor([4, 1], device=DEVICE)
    out = torch.empty(staging_shape(layers, 2, kv_layout=kv_layout), dtype=pool.dtype, device=DEVICE)
    assert out.shape[:3] == (2, 2, 2)
    assert pack_kv_pages(layers, pages, kv_layout=kv_layout, out=out) is out
    assert torch.equal(out, pages_of(pool, pages, kv_layout)[1:])

    back = torch.zeros_like(pool)
    back_layers = back[:, 1:] if kv_layout == "page_first" else back[1:]
    unpack_kv_pages(out, back_layers, pages, kv_layout=kv_layout)
    assert torch.equal(pages_of(back, pages, kv_layout)[1:], out)
    assert not pages_of(back, pages, kv_layout)[0].any()               # layer 0 untouched
    with pytest.raises(ValueError, match="layout"):
        pack_kv_pages(pool, pages, kv_layout=kv_layout, layout="HDN")
    with pytest.raises(ValueError, match="staging must be"):
        unpack_kv_pages(out, pool, pages, kv_layout=kv_layout)


def test_a_pool_that_does_not_fit_its_layout_is_refused():
    pool = torch.zeros(3, 2, 5, 4, 1, 8, device=DEVICE)       # layer-first; as page-first, K|V would be 5 wide
    pages = torch.tensor([0], device=DEVICE)
    with pytest.raises(ValueError, match="page_first buffer must be"):
        pack_kv_pages(pool, pages, kv_layout="page_first")
    with pytest.raises(ValueError, match="kv_layout must be one of"):
        pack_kv_pages(pool, pages, kv_layout="paged")
