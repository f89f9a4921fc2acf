"""Which LoRA adapters a worker keeps loaded: at most `capacity` (`--max-cpu-loras`), in least recently
used order. Bookkeeping only (names, no tensors): registry.py loads and drops the weights it names.

Invariant: an adapter that a request in flight (running or waiting) uses is never chosen to make room;
when every loaded adapter is in use, making room is refused (ResourceExhausted) rather than waited for,
so the caller's error says so at once and nothing changes.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection

from tandem.engine.errors import ResourceExhausted


class AdapterPool:
    def __init__(self, capacity: int):
        assert capacity >= 1
        self.capacity = capacity
        self._lru: OrderedDict[str, None] = OrderedDict()   # least recently used first

    def __contains__(self, name: str) -> bool:
        return name in self._lru

    def __len__(self) -> int:
        return len(self._lru)

    def names(self) -> list[str]:
        """Loaded adapters, least recently used first."""
        return list(self._lru)

    def touch(self, name: str) -> None:
        """A request used `name`: it becomes the most recently used."""
        self._lru.move_to_end(name)

    def evictions(self, name: str, in_use: Collection[str]) -> list[str]:
        """The adapters to drop (least recently used first) so that `name` fits; none when it is loaded
        or there is room. Changes nothing. Raises ResourceExhausted when the adapters not in use are too few."""
        if name in self._lru:
            return []
        need = len(self._lru) + 1 - self.capacity
        if need <= 0:
            return []
        idle = [n for n in self._lru if n not in in_use]
        if len(idle) < need:
            raise ResourceExhausted(
                f"cannot load LoRA adapter {name!r}: all {len(self._lru)} loaded adapters (--max-cpu-loras "
                f"{self.capacity}) are used by requests in flight; retry when one of them is idle")
        return idle[:need]

    def add(self, name: str) -> None:
        assert name not in self._lru and len(self._lru) < self.capacity, (name, list(self._lru))
        self._lru[name] = None

    def remove(self, name: str) -> None:
        self._lru.pop(name, None)
