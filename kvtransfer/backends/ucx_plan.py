"""The ucx backend's message plan: how one write's page runs become UCX tagged messages.

Shared by both sides and a function of the run lengths only, so P and D derive the same messages
without exchanging them: a run whose piece in one region (`PoolLayout.geometry`) is at least `DIRECT_MIN` bytes goes one
piece per message straight between the pools; smaller runs are packed whole into staging messages of
at most `STAGE_BYTES`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

DIRECT_MIN = 256 << 10        # a run's piece this large goes straight from pool to pool
STAGE_BYTES = 8 << 20         # staging message size for smaller runs


@dataclass(frozen=True)
class Msg:
    nbytes: int
    run: int                  # direct: the run; staged: the first run
    end: int = -1             # staged: one past the last run; -1 for a direct piece
    region: int = -1          # direct: the region (layer-first: a (layer, K|V); page-first: the only one)

    @property
    def staged(self) -> bool:
        return self.end >= 0


def plan_messages(lengths: np.ndarray, page_bytes: int, regions: int, direct_min: int = DIRECT_MIN,
                  stage_bytes: int = STAGE_BYTES) -> list[Msg]:
    """The messages of one write with runs of `lengths` pages, in sending order."""
    msgs: list[Msg] = []
    lo, size = 0, 0
    for j, n in enumerate(lengths.tolist()):
        piece = int(n) * page_bytes
        if piece >= direct_min:
            if size:
                msgs.append(Msg(size, lo, j))
            msgs.extend(Msg(piece, j, region=r) for r in range(regions))
            lo, size = j + 1, 0
            continue
        if size and size + piece * regions > stage_bytes:
            msgs.append(Msg(size, lo, j))
            lo, size = j, 0
        size += piece * regions
    if size:
        msgs.append(Msg(size, lo, len(lengths)))
    return msgs


def tag(token: bytes, number: int) -> int:
    return (int.from_bytes(token[:4], "little") << 32) | (number & 0xFFFFFFFF)
