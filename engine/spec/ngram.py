"""N-gram (prompt-lookup) proposer: drafts copied from the request's own tokens (torch-free).

The longest suffix of the request's tokens (prompt + output), from `max_n` down to `min_n` tokens,
is looked up earlier in the same tokens; the tokens that followed its most recent earlier occurrence
are the draft. Costless when nothing matches (no draft, plain decode for that row); very effective
when the output copies its input (code edits, quotes, summaries with citations).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from tandem.engine.scheduler.request import Request

# Only the most recent tokens are searched: a match further back is rarely the continuation, and
# the scan is Python work on the engine thread every step.
SEARCH_WINDOW = 4096


class NgramProposer:
    def __init__(self, min_n: int, max_n: int):
        assert 1 <= min_n <= max_n
        self.min_n, self.max_n = min_n, max_n

    def propose(self, ids: Sequence[int], k: int) -> list[int]:
        """Up to `k` draft tokens continuing `ids` (possibly none)."""
        if k <= 0 or len(ids) < self.min_n + 1:
            return []
        arr = np.asarray(ids[-SEARCH_WINDOW:], dtype=np.int64)
        total = arr.shape[0]
        for n in range(min(self.max_n, total - 1), self.min_n - 1, -1):
            # Start positions i of earlier occurrences (i + n <= total - 1: a continuation exists).
            starts = np.arange(total - n)
            hit = np.ones(total - n, dtype=bool)
            for j in range(n):
                hit &= arr[starts + j] == arr[total - n + j]
            found = np.flatnonzero(hit)
            if found.size:
                # The most recent occurrence with a whole k-token continuation, else the most recent
                # one (in a loop, the latest occurrence is followed by only the suffix itself).
                full = found[found + n + k <= total]
                i = int(full[-1] if full.size else found[-1]) + n
                return arr[i:i + k].tolist()
        return []


class NgramDrafts:
    """The n-gram proposer as the speculator's batch Proposer (no per-request state)."""

    def __init__(self, min_n: int, max_n: int):
        self.ngram = NgramProposer(min_n, max_n)

    def propose_batch(self, reqs: list[Request], ks: list[int]) -> list[list[int]]:
        return [self.ngram.propose(r.all_ids, k) for r, k in zip(reqs, ks, strict=True)]

    def release(self, rid: str) -> None:
        pass

    def check_idle(self) -> None:
        pass
