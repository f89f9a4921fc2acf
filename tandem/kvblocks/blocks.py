"""What a KV block is called between processes: the tier that holds it and its identity.

Workers (the tiers, the radix cache, the event publisher) and the router (its view of what every
worker holds) speak these words; neither owns them. Standard library only.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Literal


class Tier(enum.IntEnum):
    """Where a block lives; the value is the level (a lower level is faster)."""

    DEVICE = 1  # L1: the page pool (owned by the radix cache, not by a BlockStore)
    HOST = 2  # L2: host memory
    DISK = 3  # L3: local disk

    @property
    def label(self) -> str:
        """The metric / event label: "device", "host", "disk"."""
        return self.name.lower()


@dataclass(frozen=True, slots=True)
class BlockMeta:
    """A block's identity: its key, its parent's key (None when the tier does not know it, e.g. a
    disk block found by a directory scan and not read yet) and the tier that holds it."""

    key: bytes
    parent: bytes | None
    tier: Tier


EventKind = Literal["stored", "removed"]
