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

Transport: this module only builds messages (frozen dataclasses, `to_dict`/`from_dict` for JSON).
Carrying them to the router — the registry's Redis, and the router's snapshot request back to the
worker — is the worker's wiring (event_link.py, services/worker/kv_events.py), not here. Torch-free.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from engine.kvcache.tiers.base import BlockMeta, EventKind, Tier

log = logging.getLogger(__name__)

DEFAULT_MAX_BATCH = 512
_KINDS = ("stored", "removed")


def _tier_label(tier: Tier) -> str:
    return tier.label


def _tier_of(label: str) -> Tier:
    try:
        return Tier[label.upper()]
    except KeyError:
        raise ValueError(f"unknown tier {label!r}; expected one of {[t.label for t in Tier]}") from None


@dataclass(frozen=True, slots=True)
class BlockEvent:
    """One block entering ("stored") or leaving ("removed") one tier. Keys are 32 hex digits; the
    parent is None when the tier does not know it."""

    kind: EventKind
    key: str
    parent: str | None
    tier: Tier

    def __post_init__(self) -> None:
        if self.kind not in _KINDS:
            raise ValueError(f"event kind must be one of {_KINDS}, got {self.kind!r}")


@dataclass(frozen=True, slots=True)
class BlockRef:
    """A block held in a tier, as a snapshot lists it."""

    key: str
    parent: str | None
    tier: Tier


@dataclass(frozen=True, slots=True)
class KVEventBatch:
    """Events `seq` of `worker_id`'s boot `epoch`, in the order they happened."""

    worker_id: str
    epoch: int
    seq: int
    events: tuple[BlockEvent, ...]

    def to_dict(self) -> dict[str, Any]:
        return {"type": "batch", "worker_id": self.worker_id, "epoch": self.epoch, "seq": self.seq,
                "events": [[e.kind, e.key, e.parent, _tier_label(e.tier)] for e in self.events]}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> KVEventBatch:
        try:
            events = tuple(BlockEvent(kind, key, parent, _tier_of(tier)) for kind, key, parent, tier in d["events"])
            return cls(str(d["worker_id"]), int(d["epoch"]), int(d["seq"]), events)
        except (KeyError, TypeError) as e:
            raise ValueError(f"malformed KV event batch: {e!r}") from None


@dataclass(frozen=True, slots=True)
class KVSnapshot:
    """Every block `worker_id` holds, per tier, in the state `seq` of boot `epoch` names. A receiver that applies it drops batches with seq <= `seq` and applies the later ones."""

    worker_id: str
    epoch: int
    seq: int
    blocks: tuple[BlockRef, ...]

    def to_dict(self) -> dict[str, Any]:
        per_tier: dict[str, list[list[str | None]]] = {t.label: [] for t in Tier}
        for b in self.blocks:
            per_tier[_tier_label(b.tier)].append([b.key, b.parent])
        return {"type": "snapshot", "worker_id": self.worker_id, "epoch": self.epoch, "seq": self.seq,
                "blocks": per_tier}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> KVSnapshot:
        try:
            blocks = tuple(BlockRef(key, parent, _tier_of(label))
                           for label, refs in d["blocks"].items() for key, parent in refs)
            return cls(str(d["worker_id"]), int(d["epoch"]), int(d["seq"]), blocks)
        except (KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"malformed KV snapshot: {e!r}") from None


KVMessage = KVEventBatch | KVSnapshot


def message_from_dict(d: dict[str, Any]) -> KVMessage:
    """The message a `to_dict` made; ValueError for anything else."""
    kind = d.get("type") if isinstance(d, dict) else None
    if kind == "batch":
        return KVEventBatch.from_dict(d)
    if kind == "snapshot":
        return KVSnapshot.from_dict(d)
    raise ValueError(f"not a KV event message (type {kind!r})")


def new_epoch() -> int:
    """A boot epoch: the wall clock in ns, which a restarted worker does not repeat. Receivers only
    compare epochs for equality."""
    return time.time_ns()


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
