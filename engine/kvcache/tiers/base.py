"""The interface every KV tier below the page pool implements.

A tier stores blocks: opaque payloads (one page across all layers, K and V, packed by the runner)
under the 16-byte keys of `tandem.kvblocks.keys` (the vocabulary -- Tier, BlockMeta -- is there too:
the router speaks it). The store never interprets a payload and never imports
torch; the runner packs and unpacks pages.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable

from tandem.kvblocks.blocks import BlockMeta, EventKind, Tier

# Told of every block that enters or leaves a tier, for any reason (put, eviction, discard, a
# corrupt file, the tier turning itself off), so the events reproduce the tier's index.
Listener = Callable[[EventKind, BlockMeta], None]


class BlockStore(ABC):
    """One tier of blocks. Callers may rely on:

    - `get` returns the payload exactly as `put` received it, or None: a miss, which includes a block
      that turned out corrupt or foreign (it is dropped). Never wrong bytes.
    - `put` of a key already present stores nothing (a block is immutable: same key, same bytes).
    - `contains` is a hint: a block present now may be gone by the next `get` (eviction, another
      process sharing a directory); a caller that loads must handle a miss by recomputing.
    - A tier that failed at run time turns itself off: every call is then a cheap miss / no-op.
    - `close` is safe to call twice; after it the tier is off.
    """

    tier: Tier
    listener: Listener | None = None

    @abstractmethod
    def contains(self, key: bytes) -> bool: ...

    @abstractmethod
    def get(self, key: bytes) -> memoryview | bytes | None:
        """The payload, or None. Marks the block most recently used."""

    @abstractmethod
    def put(self, key: bytes, parent: bytes | None, payload: bytes | bytearray | memoryview) -> bool:
        """Store a block; True when this call stored it, False when it was already there or the
        tier is off. The tier copies `payload` before returning."""

    @abstractmethod
    def discard(self, key: bytes) -> bool:
        """Drop a block; True when it was there."""

    @abstractmethod
    def meta(self, key: bytes) -> BlockMeta | None: ...

    @abstractmethod
    def keys(self) -> list[bytes]:
        """A snapshot of the keys held, least recently used first."""

    @property
    @abstractmethod
    def capacity_bytes(self) -> int: ...

    @property
    @abstractmethod
    def used_bytes(self) -> int: ...

    @property
    @abstractmethod
    def enabled(self) -> bool: ...

    @abstractmethod
    def close(self) -> None: ...

    def __len__(self) -> int:
        return len(self.keys())

    def _emit(self, kind: EventKind, meta: BlockMeta) -> None:
        if self.listener is not None:
            self.listener(kind, meta)
