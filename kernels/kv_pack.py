"""KV pack/unpack: gather scattered pages of the pool into one contiguous staging buffer and back.

For transfer backends that want one contiguous buffer (a registered bounce buffer, one large
send) instead of a descriptor per page run. The pool (`KVPool.buffer`, or a slice of its layers) is
in either of the pool's layouts (engine/kvcache/kv_pool.py, `--kv-layout`), named by `kv_layout`:

- `layer_first`: `[L, 2, num_pages, page_size, KVH, D]`
- `page_first`: `[num_pages, L, 2, page_size, KVH, D]`

The shape alone cannot tell them apart (a two-layer page-first pool of two pages fits both), so the
caller names it. The staging buffer does not depend on it: it holds the chosen pages of every given
layer and of K and V as

- `NHD` (the pool's own page layout): `[L, 2, N, page_size, KVH, D]`
- `HND` (head-major pages, e.g. for a peer that splits KV heads differently): `[L, 2, N, KVH, page_size, D]`

One program copies a `BLOCK`-element chunk of one page of one (layer, K|V). The kernel takes every
stride of both sides, so a layout is only a view: a page-first pool is handed to it as its
`[L, 2, P, ...]` permutation, and a slice of layers in either layout is just other strides.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tandem.kernels.common import check, check_tensor, next_pow2

LAYOUTS = ("NHD", "HND")                    # staging
KV_LAYOUTS = ("layer_first", "page_first")  # pool (engine.config.KV_LAYOUTS; kernels never import engine)


@triton.jit
def _copy_pages_kernel(
    Src, Dst, PageIds,
    s_l, s_kv, s_n, s_t, s_h,
    d_l, d_kv, d_n, d_t, d_h,
    PAGE_SIZE: tl.constexpr, KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK: tl.constexpr, GATHER: tl.constexpr,
):
    n = tl.program_id(0).to(tl.int64)
    lkv = tl.program_id(1)
    layer = (lkv // 2).to(tl.int64)
    kv = lkv % 2
    page = tl.load(PageIds + n).to(tl.int64)       # n < N: the grid is exact
    if GATHER:
        src_n = page
        dst_n = n
    else:
        src_n = n
        dst_n = page
    e = tl.program_id(2) * BLOCK + tl.arange(0, BLOCK)
    mask = e < PAGE_SIZE * KV_HEADS * HEAD_DIM
    tok = e // (KV_HEADS * HEAD_DIM)
    h = (e // HEAD_DIM) % KV_HEADS
    d = e % HEAD_DIM
    x = tl.load(Src + layer * s_l + kv * s_kv + src_n * s_n + tok * s_t + h * s_h + d, mask=mask)
    tl.store(Dst + layer * d_l + kv * d_kv + dst_n * d_n + tok * d_t + h * d_h + d, x, mask=mask)


def by_layer(buffer: torch.Tensor, kv_layout: str) -> torch.Tensor:
    """The pool as a layer-first `[L, 2, P, page_size, KVH, D]` view, whichever its layout."""
    check(kv_layout in KV_LAYOUTS, f"kv_layout must be one of {KV_LAYOUTS}, got {kv_layout!r}")
    check_tensor("buffer", buffer, 6)
    view = buffer.movedim(0, 2) if kv_layout == "page_first" else buffer
    check(view.shape[1] == 2, f"a {kv_layout} buffer must be "
          f"{'[P, L, 2' if kv_layout == 'page_first' else '[L, 2, P'}, page_size, KVH, D], got {tuple(buffer.shape)}")
    return view


def staging_shape(buffer: torch.Tensor, num_pages: int, layout: str = "NHD", *, kv_layout: str) -> tuple[int, ...]:
    """The staging buffer's shape for `num_pages` pages of `buffer` (a pool in `kv_layout`)."""
    layers, two, _, page_size, kv_heads, head_dim = by_layer(buffer, kv_layout).shape
    if layout == "HND":
        return (layers, two, num_pages, kv_heads, page_size, head_dim)
    return (layers, two, num_pages, page_size, kv_heads, head_dim)


def _check(pool: torch.Tensor, page_ids: torch.Tensor, layout: str) -> None:
    check_tensor("page_ids", page_ids, 1, (torch.int32, torch.int64), pool.device)
    check(layout in LAYOUTS, f"layout must be one of {LAYOUTS}, got {layout!r}")


def _launch(src: torch.Tensor, dst: torch.Tensor, page_ids: torch.Tensor, gather: bool) -> None:
    """src/dst are logical [L, 2, n, page_size, KVH, D] views (any strides, unit last stride)."""
    layers, _, _, page_size, kv_heads, head_dim = src.shape
    num = page_ids.shape[0]
    if num == 0 or layers == 0:
        return
    page_elems = page_size * kv_heads * head_dim
    block = min(next_pow2(page_elems), 4096)
    _copy_pages_kernel[(num, layers * 2, triton.cdiv(page_elems, block))](
        src, dst, page_ids,
        *src.stride()[:5], *dst.stride()[:5],
        PAGE_SIZE=page_size, KV_HEADS=kv_heads, HEAD_DIM=head_dim, BLOCK=block, GATHER=gather,
    )


def pack_kv_pages(buffer: torch.Tensor, page_ids: torch.Tensor, *, kv_layout: str, layout: str = "NHD",
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """Copy pages `page_ids` of every layer's K and V of `buffer` (a pool in `kv_layout`) into a
    contiguous staging buffer.

    Returns `out` (allocated when None) shaped `staging_shape(buffer, len(page_ids), layout, kv_layout=...)`.
    """
    pool = by_layer(buffer, kv_layout)
    _check(pool, page_ids, layout)
    shape = staging_shape(pool, page_ids.shape[0], layout, kv_layout="layer_first")
    if out is None:
        out = torch.empty(shape, dtype=buffer.dtype, device=buffer.device)
    check(tuple(out.shape) == shape and out.dtype == buffer.dtype and out.device == buffer.device,
          f"out must be {shape} {buffer.dtype} on {buffer.device}, got {tuple(out.shape)} {out.dtype}")
    check(out.is_contiguous(), "out (the staging buffer) must be contiguous")
    dst = out.transpose(3, 4) if layout == "HND" else out
    _launch(pool, dst, page_ids, gather=True)
    return out


def unpack_kv_pages(staging: torch.Tensor, buffer: torch.Tensor, page_ids: torch.Tensor, *, kv_layout: str,
                    layout: str = "NHD") -> None:
    """Inverse of `pack_kv_pages`: scatter the staged pages into pages `page_ids` of `buffer` (a pool in
    `kv_layout`).

    Page ids must be distinct.
    """
    pool = by_layer(buffer, kv_layout)
    _check(pool, page_ids, layout)
    shape = staging_shape(pool, page_ids.shape[0], layout, kv_layout="layer_first")
    check_tensor("staging", staging, 6, (buffer.dtype,), buffer.device)
    check(tuple(staging.shape) == shape, f"staging must be {shape}, got {tuple(staging.shape)}")
    src = staging.transpose(3, 4) if layout == "HND" else staging
    _launch(src, pool, page_ids, gather=False)
