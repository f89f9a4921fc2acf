"""EventLink: what joins a worker's prefix cache (L1) and its TieredStore (L2/L3) to a
`KVEventPublisher`, and the publisher to a transport thread (torch-free).

The engine opens one when its worker publishes KV events (`LLMEngine.open_kv_events`), whether or
not the tiers are on. It gives the radix cache a key function (the block hash chain of
tandem/kvblocks/keys.py, the same one the tiers use) and two hooks: full pages entering the tree are
`stored` in L1, pages leaving it are `removed` from L1 (an eviction with tiers on is also a `stored`
in L2, which the store reports itself). Everything here runs on the engine thread, except `take`
and `want_snapshot`, which the transport thread calls: the two meet only in a bounded queue and an
Event, so a slow or dead transport never blocks a step — a full queue refuses the message and the
publisher recovers with a snapshot.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

from tandem.engine.kvcache.radix_cache import EvictedRun, RadixCache
from tandem.engine.kvcache.tiers.publisher import DEFAULT_MAX_BATCH, KVEventPublisher
from tandem.kvblocks.blocks import BlockMeta, EventKind, Tier
from tandem.kvblocks.events import KVMessage
from tandem.kvblocks.keys import ROOT, Namespace, block_hash

if TYPE_CHECKING:
    from tandem.engine.kvcache.tiers.store import TieredStore

DEFAULT_MAX_OUTBOX = 64   # messages waiting for the transport thread (a batch holds up to max_batch events)


class EventLink:
    """Lifecycle: create → `attach` to the radix cache (and store) → `open(worker_id)` once the
    transport is ready (events before it are not recorded: the first message is a snapshot) →
    engine thread: hooks, `flush()` once per tick; transport thread: `take`, `want_snapshot` →
    `close()` (safe twice).

    Callers may rely on: nothing here blocks or raises because of the transport; the outbox holds at
    most `max_outbox` messages."""

    def __init__(self, namespace: Namespace, *, max_batch: int = DEFAULT_MAX_BATCH,
                 max_outbox: int = DEFAULT_MAX_OUTBOX):
        self.namespace = namespace
        self.max_batch = max_batch
        self._outbox: queue.Queue[KVMessage] = queue.Queue(max_outbox)
        self._snapshot_wanted = threading.Event()
        self._publisher: KVEventPublisher | None = None
        self._cache: RadixCache | None = None
        self._store: TieredStore | None = None
        self.requested_snapshots = 0   # snapshots sent because a router asked
        self.refused = 0               # messages the full outbox refused

    # --- wiring (before serving) ---------------------------------------------------------------
    def key(self, parent: object | None, page_tokens: Sequence[int]) -> bytes:
        """The radix cache's `key_fn`: the block hash chain (what `TierLink.key` computes too)."""
        return block_hash(self.namespace, ROOT if parent is None else parent, page_tokens)

    def attach(self, cache: RadixCache, store: TieredStore | None = None) -> None:
        """Hook into the cache (keeping an eviction hook already there, e.g. the tiers' demotion) and
        the store's events. Call before the cache holds pages, or at least before `open`."""
        assert self._cache is None, "an EventLink follows one cache"
        if cache.key_fn is None:
            cache.key_fn = self.key
        before = cache.on_evict
        cache.on_evict = self._on_evict if before is None else _both(before, self._on_evict)
        inserted = cache.on_insert
        cache.on_insert = self._on_insert if inserted is None else _both(inserted, self._on_insert)
        self._cache = cache
        if store is not None:
            assert store.on_event is None, "the store already reports its events elsewhere"
            store.on_event = self._on_event
            self._store = store

    def open(self, worker_id: str, *, epoch: int | None = None) -> None:
        """Start recording, as `worker_id` (the first message will be a snapshot)."""
        assert self._publisher is None, "EventLink opened twice"
        self._publisher = KVEventPublisher(worker_id, self._offer, (self._blocks,), epoch=epoch,
                                           max_batch=self.max_batch)

    @property
    def publisher(self) -> KVEventPublisher | None:
        return self._publisher

    # --- engine thread -------------------------------------------------------------------------
    def flush(self) -> None:
        """Once per scheduler tick: a snapshot when a router asked for one, else the pending batch."""
        pub = self._publisher
        if pub is None:
            return
        if self._store is not None:
            self._store.drain_events()   # the disk writer's events, even while no store call comes
        if self._snapshot_wanted.is_set():
            self._snapshot_wanted.clear()
            if not pub.must_snapshot:   # otherwise flush sends one anyway
                if self._offer(pub.snapshot()):
                    self.requested_snapshots += 1
                return   # refused: the router asks again after its retry interval
        pub.flush()

    def close(self) -> None:
        if self._publisher is not None:
            self._publisher.close()

    # --- transport thread ----------------------------------------------------------------------
    def take(self, max_messages: int, timeout: float) -> list[KVMessage]:
        """Up to `max_messages` messages, in order; waits up to `timeout` s for the first."""
        try:
            out = [self._outbox.get(timeout=timeout)]
        except queue.Empty:
            return []
        while len(out) < max_messages:
            try:
                out.append(self._outbox.get_nowait())
            except queue.Empty:
                break
        return out

    def want_snapshot(self) -> None:
        """A router asked for a snapshot, or messages were lost after the outbox took them: the next
        flush sends one."""
        self._snapshot_wanted.set()

    # --- internals -----------------------------------------------------------------------------
    def _offer(self, msg: KVMessage) -> bool:
        try:
            self._outbox.put_nowait(msg)
        except queue.Full:
            self.refused += 1
            return False
        return True

    def _on_insert(self, keys: list[object], parent: object | None, pages: list[int] | None = None) -> None:
        pub = self._publisher
        if pub is None:
            return
        for key in keys:
            pub.on_event("stored", key, parent, Tier.DEVICE)
            parent = key

    def _on_evict(self, run: EvictedRun) -> None:
        pub = self._publisher
        if pub is None:
            return
        parent = run.parent
        for key in run.keys:
            pub.on_event("removed", key, parent, Tier.DEVICE)
            parent = key

    def _on_event(self, kind: EventKind, key: bytes, parent: bytes | None, tier: Tier) -> None:
        if self._publisher is not None:
            self._publisher.on_event(kind, key, parent, tier)

    def _blocks(self) -> Iterator[BlockMeta]:
        if self._cache is not None:
            for key, parent in self._cache.page_keys():
                yield BlockMeta(key, parent, Tier.DEVICE)
        if self._store is not None:
            yield from self._store.blocks()


def _both(first, second):
    """One hook calling two (an eviction's or an insert's: the tiers' first, then the events')."""
    def hook(*args) -> None:
        first(*args)
        second(*args)
    return hook
