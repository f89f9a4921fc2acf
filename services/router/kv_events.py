"""KV events, the router's side: exact per-tier views of what each worker's KV cache holds.

A worker's `KVEventPublisher` (engine/kvcache/tiers/publisher.py) sends sequence-numbered batches of
`stored` / `removed` block events and, at boot or after it lost a batch, a full snapshot. Here one
`WorkerKVView` per worker applies them in order and `KVEventIndex` holds the views of all workers.

A view is "exact" once it applied a snapshot and has missed nothing since. It turns "stale" on a
gap in the sequence, on a batch from another boot epoch (the worker restarted), or when its first
message is not a snapshot (the router restarted, or joined late); it then asks the worker for a
snapshot through `request_snapshot(worker_id)` once (again only after `snapshot_retry_s`, in case the
request or its answer was lost), ignores batches until a snapshot as recent as the newest batch it
saw arrives, and is exact again after it: batches with seq <= the snapshot's are dropped, later ones
applied. A worker with no exact view (it sends no events, or is stale now) is left to the policy's
approximate index (`cache_view.PrefixCacheView`): `has_events` says which.

Transport: messages reach `KVEventIndex.apply` however the router's wiring carries them (the
workers' Redis streams: services/router/kv_feed.py); `request_snapshot` is that wiring's way back to
the worker. Neither is here. Torch-free.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from tandem.kvblocks.blocks import Tier
from tandem.kvblocks.events import KVEventBatch, KVMessage, KVSnapshot
from tandem.kvblocks.keys import Namespace, block_hashes

# How much of a block's recompute a hit in each tier saves (1.0: all of it). An L1 hit costs nothing;
# an L2 hit costs a host-to-device copy of the page (a memcpy on CPU, PCIe on GPU: well under a tenth
# of recomputing it); an L3 hit costs a file read and checksum per page, which on a slow disk or a
# short page approaches the compute it replaces. The ordering is what matters: a worker holding a
# prefix in L1 wins over one holding it on disk, and either wins over one without it.
DEFAULT_TIER_WEIGHTS = {Tier.DEVICE: 1.0, Tier.HOST: 0.8, Tier.DISK: 0.5}
DEFAULT_SNAPSHOT_RETRY_S = 5.0


def block_keys(namespace: Namespace, token_ids: Sequence[int], parent: bytes | None = None) -> list[str]:
    """A request's block keys as workers report them: one per full page, chained from the start
    (`parent`: a LoRA adapter's key, the parent of its prompts' first pages; None: the base model's)."""
    return [k.hex() for k in block_hashes(namespace, token_ids, parent)]


class ViewState(enum.Enum):
    NEW = "new"        # nothing received yet
    EXACT = "exact"    # snapshot applied, every batch since applied
    STALE = "stale"    # waiting for a snapshot


@dataclass(frozen=True, slots=True)
class ApplyResult:
    """What `apply` did with one message: applied it, or not (a duplicate, an old epoch, a batch
    while stale), and whether it asked the worker for a snapshot."""

    applied: bool
    requested_snapshot: bool = False


class WorkerKVView:
    """One worker's blocks: key hex -> the tiers holding it. Lifecycle: create → `apply` → dropped by
    the index when the worker leaves discovery."""

    def __init__(self, worker_id: str, request_snapshot: Callable[[str], None], *,
                 snapshot_retry_s: float = DEFAULT_SNAPSHOT_RETRY_S, clock: Callable[[], float] = time.monotonic):
        self.worker_id = worker_id
        self.state = ViewState.NEW
        self.epoch: int | None = None
        self.seq = 0            # the last batch applied (or included in the snapshot applied)
        self._newest_seen = 0   # while stale: a snapshot older than this would leave a gap behind it
        self._requested_at: float | None = None
        self._request_snapshot = request_snapshot
        self._retry_s = snapshot_retry_s
        self._clock = clock
        self._where: dict[str, set[Tier]] = {}
        self.applied = self.ignored = self.snapshot_requests = 0

    @property
    def exact(self) -> bool:
        return self.state is ViewState.EXACT

    def apply(self, msg: KVMessage) -> ApplyResult:
        assert msg.worker_id == self.worker_id, f"{msg.worker_id}'s message given to {self.worker_id}'s view"
        # Any other epoch means another process, newer or (a late leftover) older: epochs are not
        # compared, so a wall clock stepped back across a restart cannot make the router ignore the
        # new process for good. A leftover costs one more snapshot request, never a wrong view for
        # longer than until the current process's next message.
        if isinstance(msg, KVSnapshot):
            return self._apply_snapshot(msg)
        if self.epoch != msg.epoch:
            # First message, or the worker restarted: what we had is gone, and this batch alone
            # cannot tell us what the new process holds.
            self._where.clear()
            self.epoch, self.seq, self._newest_seen, self._requested_at = msg.epoch, 0, 0, None
            return self._go_stale(msg.seq)
        if self.state is ViewState.STALE:
            return self._go_stale(msg.seq)
        if msg.seq <= self.seq:
            return self._ignore()   # a duplicate
        if msg.seq != self.seq + 1:
            return self._go_stale(msg.seq)
        self._apply_batch(msg)
        return ApplyResult(True)

    def match(self, block_keys: Sequence[str]) -> tuple[Tier, ...]:
        """The fastest tier of each block of the longest prefix of `block_keys` this worker holds
        (in any tier). Empty unless the view is exact."""
        if not self.exact:
            return ()
        out = []
        for key in block_keys:
            tiers = self._where.get(key)
            if not tiers:
                break
            out.append(min(tiers))
        return tuple(out)

    def blocks(self) -> dict[str, frozenset[Tier]]:
        """The view's state (for tests and debugging): key hex -> tiers."""
        return {k: frozenset(v) for k, v in self._where.items()}

    def _apply_snapshot(self, snap: KVSnapshot) -> ApplyResult:
        if snap.epoch == self.epoch and self.state is not ViewState.NEW:
            floor = self._newest_seen if self.state is ViewState.STALE else self.seq
            if snap.seq < floor:
                return self._ignore()   # older than what we have (or than what we missed)
        self._where.clear()
        for b in snap.blocks:
            self._where.setdefault(b.key, set()).add(b.tier)
        self.state, self.epoch, self.seq = ViewState.EXACT, snap.epoch, snap.seq
        self._newest_seen, self._requested_at = snap.seq, None
        self.applied += 1
        return ApplyResult(True)

    def _apply_batch(self, batch: KVEventBatch) -> None:
        for e in batch.events:
            if e.kind == "stored":
                self._where.setdefault(e.key, set()).add(e.tier)
            else:
                tiers = self._where.get(e.key)
                if tiers is not None:
                    tiers.discard(e.tier)
                    if not tiers:
                        del self._where[e.key]
        self.seq = batch.seq
        self.applied += 1

    def _go_stale(self, seq: int) -> ApplyResult:
        self.state = ViewState.STALE
        self._newest_seen = max(self._newest_seen, seq)
        self.ignored += 1
        now = self._clock()
        # One request per gap; another only if the answer is overdue (a lost request or reply).
        if self._requested_at is not None and now - self._requested_at < self._retry_s:
            return ApplyResult(False)
        self._requested_at = now
        self.snapshot_requests += 1
        self._request_snapshot(self.worker_id)
        return ApplyResult(False, requested_snapshot=True)

    def _ignore(self) -> ApplyResult:
        self.ignored += 1
        return ApplyResult(False)


class KVEventIndex:
    """Every worker's `WorkerKVView`, and the queries the routing policy asks.

    `tier_weights`: what a matched block in each tier is worth to `score`, in blocks of recompute
    saved (defaults `DEFAULT_TIER_WEIGHTS`: L1 1.0 > L2 0.8 > L3 0.5; see there for why).
    """

    def __init__(self, request_snapshot: Callable[[str], None], *, tier_weights: dict[Tier, float] | None = None,
                 snapshot_retry_s: float = DEFAULT_SNAPSHOT_RETRY_S, clock: Callable[[], float] = time.monotonic):
        weights = dict(DEFAULT_TIER_WEIGHTS if tier_weights is None else tier_weights)
        if set(weights) != set(Tier):
            raise ValueError(f"tier_weights needs a weight for each of {[t.label for t in Tier]}")
        if any(w < 0 for w in weights.values()):
            raise ValueError(f"tier weights must be >= 0, got {weights}")
        self.tier_weights = weights
        self._request_snapshot = request_snapshot
        self._retry_s = snapshot_retry_s
        self._clock = clock
        self._views: dict[str, WorkerKVView] = {}

    def apply(self, msg: KVMessage) -> ApplyResult:
        """Apply one message from any worker (a worker not seen before gets a view)."""
        view = self._views.get(msg.worker_id)
        if view is None:
            view = self._views[msg.worker_id] = WorkerKVView(
                msg.worker_id, self._request_snapshot, snapshot_retry_s=self._retry_s, clock=self._clock)
        return view.apply(msg)

    def has_events(self, worker_id: str) -> bool:
        """True when this worker's view is exact now; otherwise the policy uses its approximate index."""
        view = self._views.get(worker_id)
        return view is not None and view.exact

    def match(self, worker_id: str, block_keys: Sequence[str]) -> tuple[Tier, ...]:
        """The tier of each block of the longest prefix of `block_keys` the worker holds; empty when
        it holds none of it or `has_events` is False."""
        view = self._views.get(worker_id)
        return view.match(block_keys) if view is not None else ()

    def score(self, worker_id: str, block_keys: Sequence[str]) -> float:
        """The matched prefix weighted by tier: the sum of `tier_weights` over `match`'s blocks."""
        return sum(self.tier_weights[t] for t in self.match(worker_id, block_keys))

    def view(self, worker_id: str) -> WorkerKVView | None:
        return self._views.get(worker_id)

    def retain(self, worker_ids: Iterable[str]) -> None:
        """Forget workers that left discovery: one that comes back starts from its snapshot."""
        live = set(worker_ids)
        for wid in [w for w in self._views if w not in live]:
            del self._views[wid]

    def __len__(self) -> int:
        return len(self._views)
