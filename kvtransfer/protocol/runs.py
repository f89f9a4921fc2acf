"""Page-run merging: consecutive (src, dst) page pairs become one run, i.e. one contiguous byte range
per (layer, K|V) on each side; and cutting runs into pieces of bounded size. Torch-free."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


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


def split_runs(runs: np.ndarray, max_pages: int) -> list[np.ndarray]:
    """Cut runs `[n, 3]` (src_start, dst_start, length) into pieces of at most `max_pages` pages each, in
    order (a run that does not fit is cut too); the pieces together are the runs."""
    assert max_pages >= 1
    pieces: list[np.ndarray] = []
    piece: list[tuple[int, int, int]] = []
    room = max_pages
    for s, d, n in np.asarray(runs, dtype=np.int64).reshape(-1, 3).tolist():
        while n > 0:
            k = min(n, room)
            piece.append((s, d, k))
            s, d, n, room = s + k, d + k, n - k, room - k
            if room == 0:
                pieces.append(np.array(piece, dtype=np.int64))
                piece, room = [], max_pages
    if piece:
        pieces.append(np.array(piece, dtype=np.int64))
    return pieces


def pages_error(allowed: np.ndarray, runs: np.ndarray) -> str:
    """Why page runs `[n, 2]` (start, length) do not all lie in `allowed` ("" if they do)."""
    if runs.size == 0:
        return ""
    starts, lengths = runs[:, 0], runs[:, 1]
    if (lengths <= 0).any():
        return "empty run"
    total = int(lengths.sum())
    pages = np.repeat(starts - np.cumsum(lengths) + lengths, lengths) + np.arange(total)
    if not np.isin(pages, allowed, assume_unique=False).all():
        return "write outside the room's destination pages"
    return ""
