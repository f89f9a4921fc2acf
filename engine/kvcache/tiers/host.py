"""L2: blocks in host memory, in one arena allocated up front.

The arena is `capacity_bytes // block_bytes` fixed-size slots in one buffer; a put copies into a free
slot (or the least recently used one's) and allocates nothing. On CUDA the runner may hand in a
pinned buffer so loads back to the device can be asynchronous.

Integrity: a put records the CRC-32 of the slot it wrote and a get checks it, so a block whose bytes
changed in the arena since (a flipped bit in host memory, a stray write) is a miss, dropped and
counted (`corrupt`), never wrong KV. The price is one CRC-32 pass over the block on each side (zlib, about
4 GB/s: ~90 us for a SmolLM2 block of 360 KiB, where the copy itself takes 10-30 us).
"""

from __future__ import annotations

import logging
import zlib
from collections import OrderedDict
from collections.abc import Callable

from tandem.engine.kvcache.tiers.base import BlockStore, Listener
from tandem.kvblocks.blocks import BlockMeta, Tier

# Called with a block pushed out for capacity and its payload, which is valid only during the call
# (the slot is overwritten right after): the caller's chance to write it back to a lower tier.
EvictHook = Callable[[BlockMeta, memoryview], None]

GIB = 1 << 30

log = logging.getLogger(__name__)


class _Slot:
    __slots__ = ("index", "length", "parent", "crc")

    def __init__(self, index: int, length: int, parent: bytes | None, crc: int):
        self.index = index
        self.length = length
        self.parent = parent
        self.crc = crc


class HostTier(BlockStore):
    """LRU by key over a fixed arena. Single-threaded: the caller's thread owns it.

    `get` returns a view into the arena, valid until the next `put` or `discard` on this tier
    (either may reuse the slot): copy it out (e.g. into the page pool) before that.
    """

    tier = Tier.HOST

    def __init__(self, capacity_bytes: int, block_bytes: int, *, buffer: bytearray | memoryview | None = None,
                 on_evict: EvictHook | None = None, listener: Listener | None = None):
        if block_bytes < 1:
            raise ValueError(f"block_bytes must be >= 1, got {block_bytes}")
        num_slots = capacity_bytes // block_bytes
        if num_slots < 1:
            raise ValueError(f"--kv-host-cache-gb: {capacity_bytes / GIB:.3g} GiB holds no block of {block_bytes} bytes")
        self._block_bytes = block_bytes
        self._num_slots = num_slots
        size = num_slots * block_bytes
        if buffer is None:
            buffer = bytearray(size)
        view = memoryview(buffer).cast("B")
        if view.readonly or view.nbytes < size:
            raise ValueError(f"host arena must be a writable buffer of >= {size} bytes, got {view.nbytes}")
        self._arena: memoryview | None = view[:size]
        self._free = list(range(num_slots - 1, -1, -1))  # pop() hands out the lowest slot first
        self._lru: OrderedDict[bytes, _Slot] = OrderedDict()  # least recently used first
        self.on_evict = on_evict
        self.listener = listener
        self.evictions = 0
        self.corrupt = 0              # blocks a get found changed since their put (dropped: a miss)

    @property
    def block_bytes(self) -> int:
        return self._block_bytes

    @property
    def capacity_bytes(self) -> int:
        return self._num_slots * self._block_bytes

    @property
    def used_bytes(self) -> int:
        return len(self._lru) * self._block_bytes

    @property
    def enabled(self) -> bool:
        return self._arena is not None

    def contains(self, key: bytes) -> bool:
        return key in self._lru

    def get(self, key: bytes) -> memoryview | None:
        slot = self._lru.get(key)
        if slot is None:
            return None
        view = self._view(slot)
        if zlib.crc32(view) != slot.crc:
            self.corrupt += 1
            log.warning("KV host tier: block %s changed in memory since it was stored (CRC-32 mismatch); "
                        "dropped, it will be recomputed", key.hex())
            self.discard(key)
            return None
        self._lru.move_to_end(key)
        return view

    def put(self, key: bytes, parent: bytes | None, payload: bytes | bytearray | memoryview) -> bool:
        if self._arena is None:
            return False
        if key in self._lru:
            # Same key, same bytes: touch, never rewrite.
            self._lru.move_to_end(key)
            return False
        n = memoryview(payload).nbytes
        if n > self._block_bytes:
            raise ValueError(f"payload of {n} bytes does not fit a host slot of {self._block_bytes}")
        index = self._free.pop() if self._free else self._evict_lru()
        start = index * self._block_bytes
        self._arena[start:start + n] = memoryview(payload).cast("B")
        self._lru[key] = _Slot(index, n, parent, zlib.crc32(self._arena[start:start + n]))
        self._emit("stored", BlockMeta(key, parent, Tier.HOST))
        return True

    def discard(self, key: bytes) -> bool:
        slot = self._lru.pop(key, None)
        if slot is None:
            return False
        self._free.append(slot.index)
        self._emit("removed", BlockMeta(key, slot.parent, Tier.HOST))
        return True

    def meta(self, key: bytes) -> BlockMeta | None:
        slot = self._lru.get(key)
        return None if slot is None else BlockMeta(key, slot.parent, Tier.HOST)

    def keys(self) -> list[bytes]:
        return list(self._lru)

    def __len__(self) -> int:
        return len(self._lru)

    def close(self) -> None:
        # Drops the blocks without events: a closed tier's listener is going away too.
        self._lru.clear()
        self._free.clear()
        # Not released: views handed out by `get` may still be alive; they keep the buffer.
        self._arena = None

    def _view(self, slot: _Slot) -> memoryview:
        start = slot.index * self._block_bytes
        return self._arena[start:start + slot.length]

    def _evict_lru(self) -> int:
        key, slot = self._lru.popitem(last=False)
        self.evictions += 1
        # The slot is free before the hooks run, so a hook that raises leaks nothing.
        self._free.append(slot.index)
        meta = BlockMeta(key, slot.parent, Tier.HOST)
        if self.on_evict is not None:
            self.on_evict(meta, self._view(slot))
        self._emit("removed", meta)
        return self._free.pop()
