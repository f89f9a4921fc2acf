"""Page allocator for the paged KV pool (torch-free bookkeeping over page ids).

The pool holds `num_pages` pages; every id in 0..num_pages-1 is usable. A token's KV slot is
`page_id * page_size + offset`, but the allocator only deals in whole pages.
"""

from __future__ import annotations

from collections.abc import Iterable


class PageAllocator:
    """Hands out and takes back KV page ids.

    Callers may rely on:
    - `alloc(n)` is all-or-nothing and O(n) amortized; the pages of one call come back in
      ascending order, and from a freshly reset pool they are the lowest ids (contiguous runs
      make transfer descriptors merge).
    - `free` accepts pages in any order; freeing a page twice or an id outside the pool raises
      AssertionError (a bookkeeping bug, never a caller error) and changes nothing.
    """

    def __init__(self, num_pages: int):
        if num_pages < 0:
            raise ValueError(f"num_pages must be >= 0, got {num_pages}")
        self._num_pages = num_pages
        self.reset()

    def reset(self) -> None:
        """Mark every page free, forgetting all outstanding allocations."""
        # Sorted descending so that `pop()` / a tail slice yields the lowest ids first.
        self._sorted: list[int] = list(range(self._num_pages - 1, -1, -1))
        # Freed pages land here unsorted; sorting them on every free would cost O(pool) per
        # decode step. They are merged into `_sorted` only when it runs short, so each page is
        # sorted once per round trip and the merged list again yields contiguous runs.
        self._released: list[int] = []
        # One byte per page: the O(1) double-free / double-alloc check.
        self._is_free = bytearray(b"\x01") * self._num_pages

    @property
    def num_total(self) -> int:
        return self._num_pages

    @property
    def num_free(self) -> int:
        return len(self._sorted) + len(self._released)

    def is_free(self, page: int) -> bool:
        """Whether `page` is currently free (for checks; O(1))."""
        self._check_range(page)
        return bool(self._is_free[page])

    def alloc(self, n: int) -> list[int] | None:
        """Take `n` pages, or None (taking nothing) when fewer than `n` are free."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} pages")
        if n == 0:
            return []
        if n > len(self._sorted):
            if n > self.num_free:
                return None
            self._merge_released()
        pages = self._sorted[-n:]
        del self._sorted[-n:]
        pages.reverse()
        is_free = self._is_free
        for p in pages:
            is_free[p] = 0
        return pages

    def free(self, pages: Iterable[int]) -> None:
        """Return pages to the pool. Raises AssertionError on a double free or a bad id."""
        pages = list(pages)
        is_free = self._is_free
        # Validate everything before mutating so a failed call leaves the pool intact.
        for p in pages:
            self._check_range(p)
            if is_free[p]:
                raise AssertionError(f"double free of KV page {p}")
        if len(set(pages)) != len(pages):
            raise AssertionError(f"KV page freed twice in one call: {sorted(pages)}")
        for p in pages:
            is_free[p] = 1
        self._released.extend(pages)

    def check_all_free(self) -> None:
        """Idle self-check: raise AssertionError naming leaked pages unless all pages are free."""
        if self.num_free != self._num_pages:
            leaked = [p for p in range(self._num_pages) if not self._is_free[p]]
            shown = ", ".join(map(str, leaked[:16])) + (", ..." if len(leaked) > 16 else "")
            raise AssertionError(
                f"KV page leak: {len(leaked)} of {self._num_pages} pages still allocated (ids: {shown})"
            )

    def check_consistency(self) -> None:
        """Assert the free lists and the per-page flags agree (for tests; O(num_pages))."""
        free_ids = self._sorted + self._released
        assert len(set(free_ids)) == len(free_ids), "duplicate id in the free lists"
        assert set(free_ids) == {p for p in range(self._num_pages) if self._is_free[p]}, (
            "free lists disagree with the free flags"
        )
        assert self._sorted == sorted(self._sorted, reverse=True), "sorted free list out of order"

    def _merge_released(self) -> None:
        self._sorted.extend(self._released)
        self._released.clear()
        self._sorted.sort(reverse=True)

    def _check_range(self, page: int) -> None:
        if not 0 <= page < self._num_pages:
            raise AssertionError(f"KV page id {page} out of range [0, {self._num_pages})")
