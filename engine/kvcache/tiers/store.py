"""TieredStore: the block store below the page pool, host memory (L2) over local disk (L3).

The radix cache demotes a page it evicts from L1 (`demote`: into L2 now, onto disk behind the
caller's back), asks how far a prefix's keys reach below L1 (`lookup`), and loads the blocks of a
hit back into fresh pages (`load`). Either tier may be absent. Inclusive: a block loaded from L3
is promoted to L2 and stays on disk, and a block loaded back to L1 stays below, so demoting it again
writes nothing.

Threads: one owner thread (the scheduler's) makes every call, and one loader thread may call
`load_into` beside it (engine/kvcache/tiers/link.py); a lock keeps L2 and the counters consistent
between them, and an L3 read (file, checksum) runs outside it so the owner never waits for a disk.

Events: `on_event(kind, key, parent, tier)` hears every block that enters ("stored") or leaves
("removed") a tier. It is always called on the owner's thread, from inside a store call: events that
happen on the writer or loader thread wait in a queue until the next call (or `drain_events`).
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from time import perf_counter

from tandem.engine.kvcache.tiers.disk import DiskTier
from tandem.engine.kvcache.tiers.host import HostTier
from tandem.engine.kvcache.tiers.timings import TierOp, TierTimings
from tandem.engine.kvcache.tiers.writer import WriteBehind
from tandem.kvblocks.blocks import BlockMeta, EventKind, Tier

EventHook = Callable[[EventKind, bytes, bytes | None, Tier], None]


@dataclass(frozen=True)
class TierStats:
    tier: Tier
    enabled: bool
    blocks: int
    used_bytes: int
    capacity_bytes: int
    hits: int  # `load`s this tier answered
    bytes_read: int  # payload bytes `load` returned from it
    bytes_written: int  # payload bytes stored into it
    corrupt: int = 0  # blocks a load found damaged (checksum) and dropped: recomputed instead


@dataclass(frozen=True)
class StoreStats:
    """A snapshot of the store's counters, for metrics (`tandem_kv_tier_hits_total{tier}`, ...)."""

    tiers: tuple[TierStats, ...]
    misses: int  # `load`s no tier could answer
    pending_writes: int
    dropped_writes: int  # disk writes refused because the write queue was full

    def tier(self, tier: Tier) -> TierStats | None:
        return next((t for t in self.tiers if t.tier == tier), None)


class TieredStore:
    """Lifecycle: create (the tiers already open) → demote / lookup / load → close (drains the disk
    writes for up to `timeout`; safe twice; stop the loader first). One owner thread, e.g. the
    scheduler's, plus one loader thread calling `load_into` (see the module docstring)."""

    def __init__(self, host: HostTier | None, disk: DiskTier | None, *, on_event: EventHook | None = None,
                 max_pending_writes: int = 256):
        self.host = host
        self.disk = disk
        self.on_event = on_event
        self.timings = TierTimings()
        self._lock = threading.Lock()   # L2 and the counters: the owner's thread and the loader's
        self._writer = None
        if disk is not None:
            self._writer = WriteBehind(disk, max_pending_writes,
                                       on_written=lambda s: self.timings.block(TierOp.STORE, Tier.DISK, s))
        self._events: deque[tuple[EventKind, BlockMeta]] = deque()
        for tier in (host, disk):
            if tier is not None:
                assert tier.listener is None, "a tier belongs to one store"
                tier.listener = self._queue_event
        if host is not None and disk is not None:
            assert host.on_evict is None, "a tier belongs to one store"
            host.on_evict = self._write_back
        self._hits = {Tier.HOST: 0, Tier.DISK: 0}
        self._read = {Tier.HOST: 0, Tier.DISK: 0}
        self._host_written = 0
        self._misses = 0
        self._closed = False

    def demote(self, key: bytes, parent: bytes | None, payload: bytes | bytearray | memoryview) -> None:
        """Keep a block leaving L1: copied into L2 before returning, queued once for L3. Never
        blocks on disk. `payload` may be reused by the caller as soon as this returns."""
        if self._closed:
            return
        new = True
        with self._lock:
            if self.host is not None:
                t0 = perf_counter()
                new = self.host.put(key, parent, payload)
                if new:
                    self._host_written += memoryview(payload).nbytes
                    self.timings.block(TierOp.STORE, Tier.HOST, perf_counter() - t0)
            # A key L2 already held was queued for disk when it arrived (or is written back on eviction).
            if new:
                self._write_behind(key, parent, payload)
        self.drain_events()

    def lookup(self, keys: Sequence[bytes]) -> list[Tier]:
        """Where each of the leading keys lives, up to the first one no tier holds: the longest
        prefix of `keys` that can be loaded instead of recomputed. A hint; `load` may still miss."""
        out = []
        for key in keys:
            with self._lock:
                in_host = self.host is not None and self.host.contains(key)
            if in_host:
                out.append(Tier.HOST)
            elif self.disk is not None and (self._writer.pending(key) is not None or self.disk.contains(key)):
                out.append(Tier.DISK)
            else:
                break
        self.drain_events()
        return out

    def load(self, key: bytes) -> memoryview | bytes | None:
        """The block's payload, or None (recompute from here). A view into L2 is valid until the
        next store call; copy it into the page pool before that. An L3 hit is promoted to L2."""
        if self._closed:
            return None
        with self._lock:
            payload, tier = self._load(key)
            self._count(payload, tier)
        self.drain_events()
        return payload

    def load_into(self, key: bytes, write: Callable[[memoryview | bytes], None]) -> Tier | None:
        """Copy a block into the caller's page with `write(payload)`; returns the tier that answered,
        or None (a miss: recompute from here). For the loader thread: `write` always runs outside the
        store's lock, so the owner's demotions and lookups never wait for a page copy (which on CUDA
        may queue behind a forward pass): an L2 hit is copied out of its slot under the lock first
        (a slot may be reused as soon as the lock is released), an L3 read happens outside it and is
        then promoted to L2. Delivers no events (the owner's next call does). An exception from
        `write` propagates."""
        if self._closed:
            return None
        with self._lock:
            view = self.host.get(key) if self.host is not None else None
            if view is not None:
                payload = bytes(view)
                self._count(view, Tier.HOST)
        if view is not None:
            write(payload)
            return Tier.HOST
        payload, parent = self._read_disk(key) if self.disk is not None else (None, None)
        if payload is None:
            with self._lock:
                self._count(None, Tier.DISK)
            return None
        write(payload)
        with self._lock:
            self._promote(key, parent, payload)
            self._count(payload, Tier.DISK)
        return Tier.DISK

    def _count(self, payload: memoryview | bytes | None, tier: Tier) -> None:
        if payload is None:
            self._misses += 1
        else:
            self._hits[tier] += 1
            self._read[tier] += memoryview(payload).nbytes

    def discard(self, key: bytes) -> None:
        """Drop a block from every tier (e.g. a model reload invalidated it)."""
        if self.host is not None:
            with self._lock:
                self.host.discard(key)
        if self.disk is not None:
            self._writer.cancel(key)
            self.disk.discard(key)
        self.drain_events()

    def blocks(self) -> list[BlockMeta]:
        """Every block held, L2's then L3's: the snapshot an event consumer starts from."""
        out = []
        with self._lock:
            for tier in (self.host, self.disk):
                if tier is not None:
                    out.extend(m for m in map(tier.meta, tier.keys()) if m is not None)
        return out

    def stats(self) -> StoreStats:
        tiers = []
        with self._lock:
            for tier in (self.host, self.disk):
                if tier is None:
                    continue
                host = tier.tier == Tier.HOST
                written = self._host_written if host else self.disk.bytes_written
                corrupt = self.host.corrupt if host else self.disk.damaged
                tiers.append(TierStats(tier.tier, tier.enabled, len(tier), tier.used_bytes, tier.capacity_bytes,
                                       self._hits[tier.tier], self._read[tier.tier], written, corrupt))
            misses = self._misses
        w = self._writer
        return StoreStats(tuple(tiers), misses, w.queued if w else 0, w.dropped if w else 0)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait for the queued disk writes; False on timeout."""
        done = self._writer.flush(timeout) if self._writer is not None else True
        self.drain_events()
        return done

    def drain_events(self) -> None:
        """Deliver the events queued so far (those from the writer thread wait here)."""
        while self._events:
            kind, meta = self._events.popleft()
            if self.on_event is not None:
                self.on_event(kind, meta.key, meta.parent, meta.tier)

    def close(self, timeout: float = 5.0) -> bool:
        """Finish (or after `timeout`, abandon) the disk writes and close the tiers; True when every
        queued write was done. Safe twice."""
        if self._closed:
            return True
        self._closed = True
        done = self._writer.close(timeout) if self._writer is not None else True
        self.drain_events()
        with self._lock:
            for tier in (self.host, self.disk):
                if tier is not None:
                    tier.close()
        return done

    def _load(self, key: bytes) -> tuple[memoryview | bytes | None, Tier]:
        # Under the lock (the owner's `load`): the disk read too, which `load_into` avoids.
        if self.host is not None:
            view = self.host.get(key)
            if view is not None:
                return view, Tier.HOST
        if self.disk is None:
            return None, Tier.DISK
        payload, parent = self._read_disk(key)
        if payload is not None:
            self._promote(key, parent, payload)
        return payload, Tier.DISK

    def _read_disk(self, key: bytes) -> tuple[memoryview | bytes | None, bytes | None]:
        """(payload, parent) from L3 or a write on its way there; thread-safe (DiskTier and the
        writer lock themselves)."""
        item = self._writer.pending(key)
        if item is not None:
            parent, payload = item
            return payload, parent
        payload = self.disk.get(key)
        if payload is None:
            return None, None
        meta = self.disk.meta(key)
        return payload, meta.parent if meta is not None else None

    def _promote(self, key: bytes, parent: bytes | None, payload: memoryview | bytes) -> None:
        # The payload is the disk's own bytes (or the writer's), so this put's evictions cannot touch it.
        if self.host is not None and self.host.put(key, parent, payload):
            self._host_written += memoryview(payload).nbytes

    def _write_behind(self, key: bytes, parent: bytes | None, payload: bytes | bytearray | memoryview) -> None:
        if self._writer is None or not self.disk.enabled or self.disk.meta(key) is not None:
            return
        self._writer.submit(key, parent, payload)

    def _write_back(self, meta: BlockMeta, payload: memoryview) -> None:
        # L2 evicts a block whose disk write was dropped (queue full): one more chance.
        if self._writer.pending(meta.key) is None:
            self._write_behind(meta.key, meta.parent, payload)

    def _queue_event(self, kind: EventKind, meta: BlockMeta) -> None:
        self._events.append((kind, meta))  # deque.append is safe from the writer thread
