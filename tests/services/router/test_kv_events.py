from __future__ import annotations

import json
import random

import pytest

from tandem.engine.kvcache.tiers.publisher import KVEventPublisher
from tandem.kvblocks.blocks import BlockMeta, Tier
from tandem.kvblocks.events import KVEventBatch, KVSnapshot, message_from_dict
from tandem.kvblocks.keys import Namespace, block_hashes
from tandem.services.router.kv_events import DEFAULT_TIER_WEIGHTS, KVEventIndex, ViewState, block_keys

NS = Namespace(model="tandem-test-model", dtype="bfloat16", page_size=4, num_layers=2, kv_heads=1, head_dim=8)
KEYS = block_hashes(NS, list(range(4 * 24)))
HEX = [k.hex() for k in KEYS]


class FakeWorker:
    """A worker's tiers as a set of (key, tier), publishing every change like TieredStore does."""

    def __init__(self, worker_id="w0", epoch=1, max_batch=4):
        self.held: dict[tuple[bytes, Tier], bytes | None] = {}
        self.wire: list = []
        self.down = False
        self.pub = KVEventPublisher(worker_id, self._send, [self.blocks], epoch=epoch, max_batch=max_batch)

    def _send(self, msg) -> bool:
        if self.down:
            return False
        self.wire.append(msg)
        return True

    def blocks(self) -> list[BlockMeta]:
        return [BlockMeta(k, p, t) for (k, t), p in self.held.items()]

    def store(self, i: int, tier: Tier) -> None:
        if (KEYS[i], tier) not in self.held:
            parent = KEYS[i - 1] if i else None
            self.held[KEYS[i], tier] = parent
            self.pub.on_event("stored", KEYS[i], parent, tier)

    def remove(self, i: int, tier: Tier) -> None:
        parent = self.held.pop((KEYS[i], tier), "absent")
        if parent != "absent":
            self.pub.on_event("removed", KEYS[i], parent, tier)

    def take(self) -> list:
        out, self.wire = self.wire, []
        return out

    def truth(self) -> dict[str, frozenset[Tier]]:
        out: dict[str, set[Tier]] = {}
        for k, t in self.held:
            out.setdefault(k.hex(), set()).add(t)
        return {k: frozenset(v) for k, v in out.items()}


class Router:
    def __init__(self, **kw):
        self.requests: list[str] = []
        self.now = 0.0
        self.index = KVEventIndex(self.requests.append, clock=lambda: self.now, **kw)

    def feed(self, msgs) -> None:
        for m in msgs:
            self.index.apply(m)


def booted(**kw) -> tuple[FakeWorker, Router]:
    w, r = FakeWorker(**kw), Router()
    w.pub.flush()
    r.feed(w.take())
    return w, r


def test_batches_apply_in_order_from_the_boot_snapshot():
    w, r = booted()
    assert r.index.has_events("w0") and r.requests == []
    for i in range(6):
        w.store(i, Tier.DEVICE)
    w.remove(5, Tier.DEVICE)
    w.store(5, Tier.HOST)
    w.pub.flush()
    msgs = w.take()
    assert [m.seq for m in msgs] == [2, 3]   # the boot snapshot was 1
    r.feed(msgs)
    assert r.index.view("w0").blocks() == w.truth() and r.index.view("w0").seq == 3
    r.feed(msgs)   # a duplicate delivery changes nothing
    assert r.index.view("w0").blocks() == w.truth() and r.requests == []


def test_a_gap_asks_for_exactly_one_snapshot_and_ignores_batches_until_it_arrives():
    w, r = booted(max_batch=1)
    w.store(0, Tier.DEVICE)
    r.feed(w.take())                    # seq 2
    w.store(1, Tier.DEVICE)
    w.take()                            # seq 3 lost on the way
    for i in range(2, 5):
        w.store(i, Tier.DEVICE)
        r.feed(w.take())                # seqs 4, 5, 6: the first is the gap
    view = r.index.view("w0")
    assert r.requests == ["w0"], "one request per gap"
    assert view.state is ViewState.STALE and not r.index.has_events("w0")
    assert r.index.match("w0", HEX[:3]) == (), "a stale view answers nothing"
    assert view.blocks() == {HEX[0]: {Tier.DEVICE}}, "batches after the gap were not applied"
    snap = w.pub.snapshot()             # the worker answers the request
    w.store(5, Tier.HOST)
    late = w.take()                     # seq 7, after the snapshot (seq 6)
    r.feed([snap, *late])
    assert view.exact and view.blocks() == w.truth() and view.seq == 7
    assert r.requests == ["w0"]


def test_a_snapshot_older_than_the_newest_batch_seen_is_not_enough():
    w, r = booted(max_batch=1)
    w.store(0, Tier.DEVICE)
    w.take()                            # seq 2 lost
    old = w.pub.snapshot()              # seq 2 (say, asked for by another router earlier)
    w.store(1, Tier.DEVICE)
    r.feed(w.take())                    # seq 3: gap
    r.feed([old])
    assert r.index.view("w0").state is ViewState.STALE, "batch 3 was ignored, so snapshot 2 would leave a hole"
    r.feed([w.pub.snapshot()])
    assert r.index.view("w0").exact and r.index.view("w0").blocks() == w.truth()


def test_a_lost_snapshot_after_unrecorded_events_is_a_gap_not_a_silent_divergence():
    w, r = booted(max_batch=64)
    w.store(0, Tier.DEVICE)
    w.pub.flush()
    r.feed(w.take())
    w.down = True
    w.store(1, Tier.DEVICE)
    w.pub.flush()                       # lost: a snapshot is owed, events go unrecorded
    r.feed([w.pub.snapshot()])          # one router's earlier request answered
    w.store(2, Tier.DEVICE)             # unrecorded
    w.down = False
    w.pub.flush()
    assert [type(m) for m in w.take()] == [KVSnapshot], "the owed snapshot, lost on the way"
    w.store(3, Tier.DEVICE)
    w.pub.flush()
    r.feed(w.take())
    view = r.index.view("w0")
    assert view.state is ViewState.STALE and r.requests == ["w0"], "block 2 would be missing from an 'exact' view"
    r.feed([w.pub.snapshot()])
    assert view.exact and view.blocks() == w.truth()


def test_an_unanswered_request_is_repeated_after_the_retry_interval():
    w, r = booted(max_batch=1)
    w.store(0, Tier.DEVICE)
    w.take()
    w.store(1, Tier.DEVICE)
    r.feed(w.take())
    r.now += 1.0
    w.store(2, Tier.DEVICE)
    r.feed(w.take())
    assert r.requests == ["w0"]
    r.now += 10.0
    w.store(3, Tier.DEVICE)
    r.feed(w.take())
    assert r.requests == ["w0", "w0"]


def test_a_restarted_router_is_exact_after_the_first_snapshot():
    w, r = booted(max_batch=2)
    for i in range(10):
        w.store(i, Tier.DEVICE if i % 2 else Tier.DISK)
    r.feed(w.take())
    fresh = Router()                    # the router restarted: its first message is a batch
    w.remove(3, Tier.DEVICE)
    w.store(11, Tier.HOST)
    fresh.feed(w.take())
    assert fresh.requests == ["w0"] and not fresh.index.has_events("w0")
    fresh.feed([w.pub.snapshot()])
    w.store(12, Tier.HOST)
    w.store(13, Tier.HOST)
    fresh.feed(w.take())
    assert fresh.index.has_events("w0") and fresh.index.view("w0").blocks() == w.truth()


def test_a_restarted_worker_resets_its_view():
    w, r = booted()
    for i in range(4):
        w.store(i, Tier.DEVICE)
    w.pub.flush()
    r.feed(w.take())
    old_batch = KVEventBatch("w0", 1, 99, ())
    w2 = FakeWorker(epoch=2)            # same id, new process: L1 and L2 gone, nothing on disk
    w2.pub._must_snapshot = False       # its boot snapshot was lost: the router first sees a batch
    w2.store(0, Tier.HOST)
    w2.pub.flush()
    r.feed(w2.take())
    view = r.index.view("w0")
    assert view.state is ViewState.STALE and view.epoch == 2 and view.blocks() == {}, "the old process's blocks are gone"
    assert r.requests == ["w0"]
    r.feed([w2.pub.snapshot()])
    assert view.exact and view.epoch == 2 and view.blocks() == w2.truth() == {HEX[0]: {Tier.HOST}}
    # A late leftover of the old process costs a snapshot request, not a wrong view for long: the
    # new process's next message sets it right.
    r.feed([old_batch])
    assert not view.exact
    w2.store(1, Tier.HOST)
    w2.pub.flush()
    r.feed(w2.take())
    r.feed([w2.pub.snapshot()])
    assert view.exact and view.epoch == 2 and view.blocks() == w2.truth()
    assert r.requests == ["w0", "w0", "w0"]


def test_an_epoch_is_only_compared_for_equality():
    # A wall clock stepped back across a restart gives the new process a smaller epoch.
    w, r = booted()
    w2 = FakeWorker(epoch=0)
    w2.store(0, Tier.DEVICE)
    w2.pub.flush()
    r.feed(w2.take())
    assert r.index.view("w0").epoch == 0 and r.index.view("w0").blocks() == w2.truth()


def test_a_new_epochs_boot_snapshot_replaces_the_view_without_a_request():
    w, r = booted()
    w.store(0, Tier.DEVICE)
    w.pub.flush()
    r.feed(w.take())
    w2 = FakeWorker(epoch=5)
    w2.held[KEYS[0], Tier.DISK] = None  # a warm L3
    w2.pub.flush()
    r.feed(w2.take())
    assert r.requests == [] and r.index.view("w0").blocks() == {HEX[0]: {Tier.DISK}}


@pytest.mark.parametrize("seed", range(32))
def test_replaying_a_random_stream_equals_the_workers_state(seed):
    rng = random.Random(seed)
    w = FakeWorker(max_batch=rng.choice([1, 3, 16]))
    r = Router()
    owed = []                            # snapshots asked for, delivered a few ticks later
    checked = 0
    for tick in range(200):
        for _ in range(rng.randint(0, 6)):
            i, tier = rng.randrange(len(KEYS)), rng.choice(list(Tier))
            (w.store if rng.random() < 0.6 else w.remove)(i, tier)
        w.down = rng.random() < 0.05     # the worker's send fails now and then
        w.pub.flush()
        w.down = False
        for msg in w.take():
            if rng.random() < 0.05:
                continue                 # lost on the way to the router
            # Through JSON, as the transport will carry it.
            r.feed([message_from_dict(json.loads(json.dumps(msg.to_dict())))])
        if r.requests:
            owed.append((tick + rng.randint(0, 3), len(r.requests)))
            r.requests.clear()
        if owed and owed[0][0] <= tick:
            owed.pop(0)
            r.feed([w.pub.snapshot()])
        r.now += 1.0
        view = r.index.view("w0")
        # The invariant: a view exact at the worker's current seq holds exactly what the worker does
        # (a view behind it only finds out at the next message).
        if view is not None and view.exact and view.seq == w.pub.seq and not w.pub.must_snapshot:
            checked += 1
            assert view.blocks() == w.truth(), f"an exact view differs from the worker at tick {tick}"
    # Settle: one more tick that changes something (a view behind a lost last message finds out
    # now), and the snapshot if that asks for one.
    r.requests.clear()
    w.remove(0, Tier.DEVICE)
    w.store(0, Tier.DEVICE)
    w.pub.flush()
    r.feed(w.take())
    if r.requests or owed:
        r.feed([w.pub.snapshot()])     # the answer to the (last) request
    view = r.index.view("w0")
    assert view.exact and view.seq == w.pub.seq and view.blocks() == w.truth()
    assert checked > 100, "the invariant was checked on most ticks"


def test_match_and_score_with_mixed_tiers():
    w, r = booted(max_batch=64)
    for i, tier in enumerate([Tier.DEVICE, Tier.DEVICE, Tier.HOST, Tier.DISK]):
        w.store(i, tier)
    w.store(1, Tier.DISK)                 # in L1 and L3: counts as L1
    w.store(5, Tier.DEVICE)               # block 4 missing: the run stops before 5
    w.pub.flush()
    r.feed(w.take())
    keys = block_keys(NS, list(range(4 * 6 + 2)))   # the trailing partial page has no key
    assert keys == HEX[:6]
    assert r.index.match("w0", keys) == (Tier.DEVICE, Tier.DEVICE, Tier.HOST, Tier.DISK)
    other_start = block_keys(NS, [999] * 4 + list(range(4, 24)))
    assert r.index.match("w0", other_start) == (), "a different first page changes every key after it"
    wt = DEFAULT_TIER_WEIGHTS
    assert r.index.score("w0", keys) == pytest.approx(2 * wt[Tier.DEVICE] + wt[Tier.HOST] + wt[Tier.DISK])
    assert wt[Tier.DEVICE] > wt[Tier.HOST] > wt[Tier.DISK] > 0
    # An L1 prefix beats the same prefix held on disk.
    w2 = FakeWorker("w1")
    w2.pub.flush()
    for i in range(4):
        w2.store(i, Tier.DISK)
    w2.pub.flush()
    r.feed(w2.take())
    assert r.index.score("w0", keys) > r.index.score("w1", keys) > 0
    flat = KVEventIndex(lambda _: None, tier_weights={t: 1.0 for t in Tier})
    flat.apply(w.pub.snapshot())
    assert flat.score("w0", keys) == 4.0
    with pytest.raises(ValueError):
        KVEventIndex(lambda _: None, tier_weights={Tier.DEVICE: 1.0})


def test_has_events_is_false_for_workers_that_send_none_and_retain_drops_workers():
    w, r = booted()
    assert r.index.has_events("w0")
    assert not r.index.has_events("w-silent") and r.index.match("w-silent", HEX[:2]) == ()
    assert r.index.score("w-silent", HEX[:2]) == 0.0
    r.index.retain(["w-silent"])
    assert r.index.view("w0") is None and not r.index.has_events("w0") and len(r.index) == 0
    w.store(0, Tier.DEVICE)
    w.pub.flush()
    r.feed(w.take())                      # back in discovery: starts over from a snapshot
    assert r.requests == ["w0"] and not r.index.has_events("w0")
