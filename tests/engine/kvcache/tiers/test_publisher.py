from __future__ import annotations

import pytest

from tandem.engine.kvcache.tiers.host import HostTier
from tandem.engine.kvcache.tiers.publisher import KVEventPublisher
from tandem.engine.kvcache.tiers.store import TieredStore
from tandem.kvblocks.blocks import BlockMeta, Tier
from tandem.kvblocks.events import BlockEvent, BlockRef, KVEventBatch, KVSnapshot
from tandem.kvblocks.keys import Namespace, block_hashes

NS = Namespace(model="tandem-test-model", dtype="bfloat16", page_size=4, num_layers=2, kv_heads=1, head_dim=8)
BLOCK = NS.block_bytes(2)
KEYS = block_hashes(NS, list(range(4 * 16)))


class Wire:
    """A `send` that records what it took, and refuses while `down`."""

    def __init__(self):
        self.sent = []
        self.down = False
        self.raises = False

    def __call__(self, msg) -> bool:
        if self.raises:
            raise ConnectionError("registry gone")
        if self.down:
            return False
        self.sent.append(msg)
        return True


def make(max_batch=4, blocks=()):
    wire = Wire()
    state = list(blocks)
    pub = KVEventPublisher("w0", wire, [lambda: list(state)], epoch=7, max_batch=max_batch)
    return pub, wire, state


def test_the_first_message_is_a_snapshot_and_events_before_it_are_in_it():
    pub, wire, state = make(blocks=[BlockMeta(KEYS[0], None, Tier.DISK)])   # a warm L3 from the last run
    pub.on_event("stored", KEYS[0], None, Tier.DISK)   # already in the snapshot: not sent twice
    pub.flush()
    assert wire.sent == [KVSnapshot("w0", 7, 1, (BlockRef(KEYS[0].hex(), None, Tier.DISK),))]
    pub.flush()
    assert len(wire.sent) == 1, "nothing pending, nothing sent"


def test_batches_by_count_and_by_flush_with_consecutive_seqs():
    pub, wire, _ = make(max_batch=3)
    pub.flush()
    wire.sent.clear()
    for i in range(7):
        pub.on_event("stored", KEYS[i], KEYS[i - 1] if i else None, Tier.HOST)
    assert [m.seq for m in wire.sent] == [2, 3], "a batch goes out as soon as it has max_batch events"
    pub.flush()
    assert [m.seq for m in wire.sent] == [2, 3, 4]
    assert [len(m.events) for m in wire.sent] == [3, 3, 1]
    assert all(isinstance(m, KVEventBatch) and m.worker_id == "w0" and m.epoch == 7 for m in wire.sent)
    events = [e for m in wire.sent for e in m.events]
    assert events[1] == BlockEvent("stored", KEYS[1].hex(), KEYS[0].hex(), Tier.HOST)
    assert [e.key for e in events] == [k.hex() for k in KEYS[:7]], "in the order they happened"
    assert pub.stats().events_sent == 7 and pub.stats().batches_sent == 3


@pytest.mark.parametrize("failure", ["refused", "raises"])
def test_a_failed_send_drops_the_batch_and_the_next_message_is_a_snapshot(failure):
    pub, wire, state = make(max_batch=100)
    pub.flush()
    pub.on_event("stored", KEYS[0], None, Tier.HOST)
    pub.flush()                                           # seq 2 delivered
    setattr(wire, "down" if failure == "refused" else "raises", True)
    pub.on_event("stored", KEYS[1], KEYS[0], Tier.HOST)
    pub.flush()                                           # seq 3 lost
    assert pub.must_snapshot and pub.stats().batches_dropped == 1
    wire.down = wire.raises = False
    pub.on_event("removed", KEYS[0], None, Tier.HOST)     # the snapshot will read the state itself
    state[:] = [BlockMeta(KEYS[1], KEYS[0], Tier.HOST)]
    pub.flush()
    snap = wire.sent[-1]
    assert isinstance(snap, KVSnapshot) and snap.seq == 4, "the lost batch's seq stays used, and events went unrecorded"
    assert snap.blocks == (BlockRef(KEYS[1].hex(), KEYS[0].hex(), Tier.HOST),)
    pub.on_event("stored", KEYS[2], KEYS[1], Tier.DISK)
    pub.flush()
    assert wire.sent[-1].seq == 5 and not pub.must_snapshot


def test_a_refused_snapshot_is_owed_until_delivered_and_memory_stays_bounded():
    pub, wire, _ = make(max_batch=2)
    wire.down = True
    pub.flush()
    for i in range(50):
        pub.on_event("stored", KEYS[i % len(KEYS)], None, Tier.HOST)
    assert len(pub._pending) == 0, "events are not kept while a snapshot is owed"
    wire.down = False
    pub.flush()
    assert [type(m) for m in wire.sent] == [KVSnapshot]
    for i in range(5):
        pub.on_event("stored", KEYS[i], None, Tier.HOST)
        assert len(pub._pending) < pub.max_batch


def test_snapshot_includes_the_pending_events_batch_first():
    pub, wire, state = make(max_batch=100)
    pub.flush()
    pub.on_event("stored", KEYS[0], None, Tier.DEVICE)
    state.append(BlockMeta(KEYS[0], None, Tier.DEVICE))
    snap = pub.snapshot()
    assert [m.seq for m in wire.sent[1:]] == [2] and snap.seq == 2
    assert snap.blocks == (BlockRef(KEYS[0].hex(), None, Tier.DEVICE),)
    assert wire.sent[-1] is not snap, "snapshot() hands the snapshot back; the caller sends it"


def test_a_snapshot_built_while_one_is_owed_takes_a_seq_of_its_own():
    # Events went unrecorded, so the state moved without a batch: the old seq no longer names it.
    pub, wire, _ = make()
    pub.flush()
    wire.down = True
    pub.on_event("stored", KEYS[0], None, Tier.HOST)
    pub.flush()
    assert pub.seq == 2 and pub.must_snapshot
    assert pub.snapshot().seq == 3 and pub.must_snapshot, "an answer to one router; everyone is still owed one"
    wire.down = False
    pub.flush()
    assert wire.sent[-1].seq == 4 and isinstance(wire.sent[-1], KVSnapshot) and not pub.must_snapshot
    assert pub.snapshot().seq == 4, "nothing unrecorded since: the same state, the same seq"


def test_close_is_safe_twice_and_stops_publishing():
    pub, wire, _ = make()
    pub.flush()
    pub.on_event("stored", KEYS[0], None, Tier.HOST)
    pub.close()
    pub.close()
    pub.on_event("stored", KEYS[1], None, Tier.HOST)
    pub.flush()
    assert len(wire.sent) == 1
    with pytest.raises(ValueError):
        KVEventPublisher("w", wire, [], max_batch=0)


def test_a_tiered_stores_events_replayed_equal_its_blocks():
    # The real store as the source: its evictions (L2 holds 3 blocks) come through on_event too.
    wire = Wire()
    store = TieredStore(HostTier(3 * BLOCK, BLOCK), None)
    pub = KVEventPublisher("w0", wire, [store.blocks], epoch=1, max_batch=2)
    store.on_event = pub.on_event
    try:
        pub.flush()
        for i, key in enumerate(KEYS[:8]):
            store.demote(key, KEYS[i - 1] if i else None, bytes([i]) * BLOCK)
            if i == 5:
                store.discard(KEYS[4])
        store.drain_events()
        pub.flush()
        held: set[tuple[str, Tier]] = {(b.key, b.tier) for b in wire.sent[0].blocks}
        for batch in wire.sent[1:]:
            for e in batch.events:
                (held.add if e.kind == "stored" else held.discard)((e.key, e.tier))
        assert held == {(m.key.hex(), m.tier) for m in store.blocks()}
        assert len(held) == 3 and any(e.kind == "removed" for m in wire.sent[1:] for e in m.events)
    finally:
        store.close()
