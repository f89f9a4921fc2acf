"""Latency samples of the KV tiers, kept until the metrics export takes them (torch-free).

The store, its disk writer and the loader record from their own threads; a worker's metrics export
drains the samples into histograms (services/worker/metrics.py). Bounded: when nobody drains (an
engine without a metrics endpoint) the oldest samples go.
"""

from __future__ import annotations

import enum
from collections import deque

from tandem.kvblocks.blocks import Tier


class TierOp(enum.Enum):
    LOAD = "load"      # one block from a tier into a page of the pool (read, checksum, copy)
    STORE = "store"    # one block into a tier (L2: the demotion copy; L3: the write-behind file write)


class TierTimings:
    """(op, tier, seconds) per block, and the seconds each request waited for its whole load."""

    def __init__(self, max_samples: int = 4096):
        self._blocks: deque[tuple[TierOp, Tier, float]] = deque(maxlen=max_samples)
        self._loads: deque[float] = deque(maxlen=max_samples)

    def block(self, op: TierOp, tier: Tier, seconds: float) -> None:
        self._blocks.append((op, tier, seconds))   # deque.append is atomic: any thread may record

    def load(self, seconds: float) -> None:
        self._loads.append(seconds)

    def drain(self) -> tuple[list[tuple[TierOp, Tier, float]], list[float]]:
        """The samples recorded since the last call: per block, per request load."""
        return _take(self._blocks), _take(self._loads)


def _take(q: deque) -> list:
    out = []
    while True:
        try:
            out.append(q.popleft())
        except IndexError:
            return out
