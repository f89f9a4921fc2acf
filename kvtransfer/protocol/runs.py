"""Page-run merging: consecutive (src, dst) page pairs become one run, i.e. one contiguous byte range
per (layer, K|V) on each side. Torch-free."""

from __future__ import annotations

from collections.abc import Sequence


def merge_runs(src_pages: Sequence[int], dst_pages: Sequence[int]) -> list[tuple[int, int, int]]:
    """Merge page pairs into `(src_start, dst_start, length)` runs, in order.

    Pair i and i+1 join the same run when both `src` and `dst` advance by exactly one page, so
    expanding the runs gives back the pairs in their original order.
    """
    if len(src_pages) != len(dst_pages):
        raise ValueError(f"src_pages ({len(src_pages)}) and dst_pages ({len(dst_pages)}) differ in length")
    runs: list[tuple[int, int, int]] = []
    it = zip(src_pages, dst_pages, strict=True)
    for s0, d0 in it:
        s_start, d_start, length = int(s0), int(d0), 1
        break
    else:
        return runs
    for s, d in it:
        s, d = int(s), int(d)
        if s == s_start + length and d == d_start + length:
            length += 1
        else:
            runs.append((s_start, d_start, length))
            s_start, d_start, length = s, d, 1
    runs.append((s_start, d_start, length))
    return runs


def expand_runs(runs: Sequence[tuple[int, int, int]]) -> tuple[list[int], list[int]]:
    """Inverse of `merge_runs`: the (src_pages, dst_pages) pairs the runs cover."""
    src: list[int] = []
    dst: list[int] = []
    for s, d, n in runs:
        src.extend(range(s, s + n))
        dst.extend(range(d, d + n))
    return src, dst
