"""EventLink (torch-free): a KVManager's prefix cache reports full-page inserts as `stored` L1 and
evictions as `removed` L1 (with keys even when the tiers are off), the tiers their own L2 events;
a router-side index fed the messages holds exactly the worker's blocks; a full outbox and a
router's request both end in a snapshot."""

from __future__ import annotations

from tandem.engine.kvcache.kv_manager import KVManager
from tandem.engine.kvcache.tiers.event_link import EventLink
from tandem.engine.kvcache.tiers.host import HostTier
from tandem.engine.kvcache.tiers.link import TierLink
from tandem.engine.kvcache.tiers.store import TieredStore
from tandem.kvblocks.blocks import Tier
from tandem.kvblocks.events import KVEventBatch, KVSnapshot
from tandem.kvblocks.keys import Namespace, block_hashes
from tandem.services.router.kv_events import KVEventIndex

PS = 4
BLOCK = 8
NS = Namespace("test-model", "float32", PS, 1, 1, 1)


def manager(num_pages: int = 8, store: TieredStore | None = None, max_outbox: int = 64):
    tiers = None
    if store is not None:
        tiers = TierLink(store, NS, lambda page: bytes(BLOCK), lambda page, payload: None)
    kv = KVManager(num_pages, PS, 4, True, tiers)
    link = EventLink(NS, max_outbox=max_outbox)
    link.attach(kv.cache, store)
    return kv, link


def cache(kv: KVManager, tokens: list[int]) -> None:
    pages = kv.allocator.alloc(len(tokens) // PS)
    kv.allocator.free(kv.cache.insert(tokens, pages))


def held(kv: KVManager, store: TieredStore | None = None) -> dict[str, frozenset[Tier]]:
    out: dict[str, set[Tier]] = {}
    for key, _ in kv.cache.page_keys():
        out.setdefault(key.hex(), set()).add(Tier.DEVICE)
    for meta in store.blocks() if store is not None else ():
        out.setdefault(meta.key.hex(), set()).add(meta.tier)
    return {k: frozenset(v) for k, v in out.items()}


def drain(link: EventLink, index: KVEventIndex) -> list:
    msgs = link.take(1000, timeout=0)
    for m in msgs:
        index.apply(m)
    return msgs


def test_inserts_and_evictions_are_l1_events_with_block_hash_keys_without_tiers():
    kv, link = manager()
    link.open("w", epoch=1)
    index = KVEventIndex(lambda wid: None)
    link.flush()
    [snap] = drain(link, index)
    assert isinstance(snap, KVSnapshot) and snap.blocks == ()
    tokens = list(range(12))
    cache(kv, tokens)
    link.flush()
    [batch] = drain(link, index)
    keys = [k.hex() for k in block_hashes(NS, tokens)]
    assert isinstance(batch, KVEventBatch)
    assert [(e.kind, e.key, e.tier) for e in batch.events] == [("stored", k, Tier.DEVICE) for k in keys]
    assert [e.parent for e in batch.events] == [None, keys[0], keys[1]]
    assert index.match("w", keys) == (Tier.DEVICE,) * 3
    cache(kv, tokens)   # already held: nothing new
    link.flush()
    assert drain(link, index) == []
    kv.cache.evict(1)   # the tail page goes
    link.flush()
    [batch] = drain(link, index)
    assert [(e.kind, e.key) for e in batch.events] == [("removed", keys[2])]
    assert index.view("w").blocks() == held(kv)


def test_with_tiers_an_eviction_is_removed_from_l1_and_stored_in_l2():
    store = TieredStore(HostTier(BLOCK * 16, BLOCK), None)
    kv, link = manager(store=store)
    link.open("w", epoch=1)
    index = KVEventIndex(lambda wid: None)
    tokens = list(range(16))
    cache(kv, tokens)
    kv.cache.evict(2)
    link.flush()
    drain(link, index)
    keys = [k.hex() for k in block_hashes(NS, tokens)]
    assert index.match("w", keys) == (Tier.DEVICE, Tier.DEVICE, Tier.HOST, Tier.HOST)
    assert index.view("w").blocks() == held(kv, store)


def test_full_outbox_and_a_router_request_end_in_a_snapshot_equal_to_the_cache():
    kv, link = manager(num_pages=16, max_outbox=1)
    link.open("w", epoch=1)
    asked: list[str] = []
    index = KVEventIndex(asked.append)
    link.flush()
    drain(link, index)
    cache(kv, list(range(8)))
    link.flush()                      # batch 1 queued
    cache(kv, list(range(100, 108)))
    link.flush()                      # batch 2 refused: the outbox is full
    assert link.refused == 1
    drain(link, index)                # batch 1 applied
    cache(kv, list(range(200, 204)))
    link.flush()                      # owed: a snapshot, not batch 3
    [snap] = drain(link, index)
    assert isinstance(snap, KVSnapshot)
    assert index.has_events("w") and index.view("w").blocks() == held(kv)
    # A restarted router: a new index, told nothing until it asks.
    index2 = KVEventIndex(asked.append)
    link.want_snapshot()
    link.flush()
    [snap2] = drain(link, index2)
    assert isinstance(snap2, KVSnapshot) and link.requested_snapshots == 1
    assert index2.view("w").blocks() == held(kv)


def test_nothing_is_recorded_before_open_and_the_first_message_is_a_snapshot():
    kv, link = manager()
    cache(kv, list(range(8)))
    link.flush()
    assert link.take(10, timeout=0) == []
    link.open("w", epoch=1)
    link.flush()
    [snap] = link.take(10, timeout=0)
    assert {b.key for b in snap.blocks} == {k.hex() for k in block_hashes(NS, list(range(8)))}
