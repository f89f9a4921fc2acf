"""Request slots: a bounded table mapping each running request's slot to its KV page list.

The table does not own pages: whoever frees a slot frees its pages to the allocator first.
"""

from __future__ import annotations

from collections.abc import Iterable


class ReqToPageTable:
    """Fixed number of request slots, each holding the request's page ids in token order."""

    def __init__(self, max_slots: int):
        if max_slots < 0:
            raise ValueError(f"max_slots must be >= 0, got {max_slots}")
        self._max_slots = max_slots
        # Descending so `pop()` hands out the lowest free slot first.
        self._free = list(range(max_slots - 1, -1, -1))
        self._in_use = [False] * max_slots
        self._pages: list[list[int]] = [[] for _ in range(max_slots)]

    @property
    def num_total_slots(self) -> int:
        return self._max_slots

    @property
    def num_free_slots(self) -> int:
        return len(self._free)

    def alloc_slot(self) -> int | None:
        """Take a free slot (with an empty page list), or None when all are in use."""
        if not self._free:
            return None
        slot = self._free.pop()
        self._in_use[slot] = True
        return slot

    def free_slot(self, slot: int) -> None:
        """Release `slot` and clear its page list. AssertionError if it is not in use."""
        self._check_in_use(slot)
        self._in_use[slot] = False
        self._pages[slot] = []
        self._free.append(slot)

    def pages(self, slot: int) -> list[int]:
        """The slot's page list. Live, not a copy: change it only through the setters."""
        self._check_in_use(slot)
        return self._pages[slot]

    def set_pages(self, slot: int, pages: Iterable[int]) -> None:
        self._check_in_use(slot)
        self._pages[slot] = list(pages)

    def append_pages(self, slot: int, pages: Iterable[int]) -> None:
        self._check_in_use(slot)
        self._pages[slot].extend(pages)

    def check_all_free(self) -> None:
        """Idle self-check: AssertionError naming the slots still in use, if any."""
        if len(self._free) != self._max_slots:
            used = [s for s in range(self._max_slots) if self._in_use[s]]
            raise AssertionError(f"request slot leak: {len(used)} of {self._max_slots} in use: {used[:16]}")

    def _check_in_use(self, slot: int) -> None:
        if not (0 <= slot < self._max_slots and self._in_use[slot]):
            raise AssertionError(f"request slot {slot} is not in use (double free or bad id)")
