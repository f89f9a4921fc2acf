"""The KV-event format: what a worker tells the router about the blocks it holds, and the snapshot
the router asks for. Messages are frozen dataclasses with `to_dict` / `from_dict` (JSON on the wire:
the registry's Redis stream); `message_from_dict` reads either kind.

Every message is stamped with (worker_id, epoch, seq): `epoch` names one boot of the worker, `seq`
increases by one per message within it, and a snapshot at seq s is the state after batch s (the
publisher's rules: engine/kvcache/tiers/publisher.py; the receiver's: services/router/kv_events.py).
Standard library only: both sides import it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from tandem.kvblocks.blocks import EventKind, Tier

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
