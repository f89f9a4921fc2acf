"""KV events, the worker's side: what blocks this worker holds, in which tier, told to the router.

`KVEventPublisher.on_event(kind, key, parent, tier)` has `TieredStore.on_event`'s signature (and is
what the radix cache's L1 inserts and evictions are to be reported through). Events are collected
into one batch and handed to `send` when the batch reaches `max_batch` events, or when the caller
calls `flush()` (once per scheduler tick). No threads, no timers: everything happens inside the
caller's calls.

Every message is stamped with (worker_id, epoch, seq). `epoch` names this process's boot (a restarted
worker has another one); `seq` increases by one per batch within an epoch. The invariant receivers
rely on: seq s names one state, the blocks held after batch s, and a snapshot at seq s is that state,
so a receiver that applies it and then the batches after it is exact again. While a snapshot is owed
events are not recorded, so the state moves without a batch: a snapshot built then takes a seq of its
own (a receiver that misses it sees a gap instead of applying later batches to an old state).

Bounded memory: pending events never exceed `max_batch`. A batch `send` did not accept is dropped (its
seq stays used, so receivers see a gap), and so is everything after it until the next message, which
is then a snapshot built from `sources` (callables returning the current `BlockMeta`s, e.g. the radix
cache's L1 blocks and `TieredStore.blocks`). The first message of an epoch is a snapshot too: an L3
directory survives a restart, so a new worker may start warm.

Messages: the format both sides share is `tandem.kvblocks.events` (frozen dataclasses, `to_dict` /
`from_dict` for JSON); this module only builds them. Carrying them to the router — the registry's Redis, and the router's snapshot request back to the
worker — is the worker's wiring (event_link.py, services/worker/kv_events.py), not here. Torch-free.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from tandem.kvblocks.blocks import BlockMeta, EventKind, Tier
from tandem.kvblocks.events import BlockEvent, BlockRef, KVEventBatch, KVMessage, KVSnapshot, new_epoch

log = logging.getLogger(__name__)

DEFAULT_MAX_BATCH = 512


# True when the transport took the message. False or an exception: it did not (e.g. a full queue,
# a closed connection), and the publisher recovers with a snapshot.
Send = Callable[[KVMessage], bool]
Source = Callable[[], Iterable[BlockMeta]]


@dataclass(frozen=True, slots=True)
class PublisherStats:
    """Counters for metrics (events published, batches dropped, snapshots sent)."""

    events_sent: int
    batches_sent: int
    batches_dropped: int
    snapshots_sent: int
    seq: int


class KVEventPublisher:
    """Lifecycle: create → `on_event` from the store / radix cache → `flush()` each scheduler tick
    (and `snapshot()` when a router asks) → `close()` (safe twice; later events are ignored).

    Callers may rely on: seqs increase by one per message built in one epoch, nothing is re-sent;
    after a lost batch the next message `send` sees is a snapshot; `on_event`, `flush` and
    `snapshot` never raise because of the transport.
    """

    def __init__(self, worker_id: str, send: Send, sources: Sequence[Source], *, epoch: int | None = None,
                 max_batch: int = DEFAULT_MAX_BATCH):
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        self.worker_id = worker_id
        self.epoch = new_epoch() if epoch is None else epoch
        self.max_batch = max_batch
        self._send = send
        self._sources = tuple(sources)
        self._pending: list[BlockEvent] = []
        self._seq = 0
        # The receivers' view of this worker cannot be rebuilt from batches: the next message must be
        # a snapshot. True at boot (the first message of an epoch is a snapshot).
        self._must_snapshot = True
        self._closed = False
        self._events_sent = self._batches_sent = self._dropped = self._snapshots = 0

    @property
    def seq(self) -> int:
        """The last seq given to a message (sent or dropped)."""
        return self._seq

    @property
    def must_snapshot(self) -> bool:
        return self._must_snapshot

    def on_event(self, kind: EventKind, key: bytes, parent: bytes | None, tier: Tier) -> None:
        """Record one block entering or leaving a tier (`TieredStore.on_event`'s signature)."""
        if self._closed or self._must_snapshot:
            return  # the snapshot to come reads the state itself
        self._pending.append(BlockEvent(kind, key.hex(), parent.hex() if parent is not None else None, tier))
        if len(self._pending) >= self.max_batch:
            self.flush()

    def flush(self) -> None:
        """Send the pending events as one batch (nothing when there are none), or the snapshot that
        is owed. Call once per scheduler tick."""
        if self._closed:
            return
        if self._must_snapshot:
            self._pending.clear()
            snap = self.snapshot()
            if self._deliver(snap):
                self._must_snapshot = False
                self._snapshots += 1
            return
        if not self._pending:
            return
        self._seq += 1
        batch = KVEventBatch(self.worker_id, self.epoch, self._seq, tuple(self._pending))
        self._pending.clear()
        if self._deliver(batch):
            self._batches_sent += 1
            self._events_sent += len(batch.events)
        else:
            self._dropped += 1
            self._must_snapshot = True

    def snapshot(self) -> KVSnapshot:
        """The full state now, stamped with the current seq (a new one while a snapshot is owed).
        Pending events are flushed first, so the snapshot includes exactly the batches up to its
        seq. Sends nothing itself (but the flush may); the caller sends it to whoever asked."""
        if self._pending and not self._must_snapshot:
            self.flush()
        if self._must_snapshot:
            self._seq += 1   # events were dropped since the last seq: this state gets a seq of its own
        blocks = tuple(BlockRef(m.key.hex(), m.parent.hex() if m.parent is not None else None, m.tier)
                       for source in self._sources for m in source())
        return KVSnapshot(self.worker_id, self.epoch, self._seq, blocks)

    def stats(self) -> PublisherStats:
        return PublisherStats(self._events_sent, self._batches_sent, self._dropped, self._snapshots, self._seq)

    def close(self) -> None:
        """Stop publishing; pending events are dropped (the worker is going away). Safe twice."""
        self._closed = True
        self._pending.clear()

    def _deliver(self, msg: KVMessage) -> bool:
        try:
            ok = bool(self._send(msg))
        except Exception as e:  # a failed transport must not fail a scheduler tick
            log.warning("KV events: send of %s seq %d failed: %r", type(msg).__name__, msg.seq, e)
            return False
        if not ok:
            log.debug("KV events: %s seq %d not accepted", type(msg).__name__, msg.seq)
        return ok
