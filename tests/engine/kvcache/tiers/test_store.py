from __future__ import annotations

import errno
import os
import threading

import pytest

from tandem.engine.kvcache.tiers import disk as disk_module
from tandem.engine.kvcache.tiers.disk import HEADER_BYTES, DiskTier
from tandem.engine.kvcache.tiers.host import HostTier
from tandem.engine.kvcache.tiers.store import TieredStore
from tandem.kvblocks.blocks import Tier
from tandem.kvblocks.keys import Namespace, block_hashes

NS = Namespace(model="tandem-test-model", dtype="bfloat16", page_size=4, num_layers=2, kv_heads=1, head_dim=8)
BLOCK = NS.block_bytes(2)  # 256
KEYS = block_hashes(NS, list(range(4 * 32)))
PARENT = [None] + KEYS[:-1]


def payload(i: int) -> bytes:
    return bytes([i % 256]) * BLOCK


_open: list[TieredStore] = []


@pytest.fixture(autouse=True)
def no_store_outlives_its_test():
    before = set(threading.enumerate())
    yield
    while _open:
        _open.pop().close()
    assert set(threading.enumerate()) <= before, "a writer thread outlived its store"


def make(tmp_path, host_blocks: int | None = 4, disk: bool = True, **kw) -> tuple[TieredStore, list]:
    events = []
    host = HostTier(host_blocks * BLOCK, BLOCK) if host_blocks else None
    d = DiskTier(tmp_path, 1 << 20, NS) if disk else None
    store = TieredStore(host, d, on_event=lambda *e: events.append(e), **kw)
    _open.append(store)
    return store, events


def demote(store: TieredStore, *indices: int) -> None:
    for i in indices:
        store.demote(KEYS[i], PARENT[i], payload(i))


def test_demote_goes_to_host_now_and_to_disk_behind(tmp_path):
    store, events = make(tmp_path)
    demote(store, 0, 1)
    assert store.host.keys() == KEYS[:2]
    assert store.flush(5)
    assert set(store.disk.keys()) == set(KEYS[:2])
    assert bytes(store.disk.get(KEYS[1])) == payload(1) and store.disk.meta(KEYS[1]).parent == KEYS[0]
    assert events[:2] == [("stored", KEYS[0], None, Tier.HOST), ("stored", KEYS[1], KEYS[0], Tier.HOST)]
    assert sorted(events[2:]) == sorted([("stored", KEYS[0], None, Tier.DISK), ("stored", KEYS[1], KEYS[0], Tier.DISK)])
    assert store.close()


def test_a_block_is_written_to_disk_once(tmp_path):
    store, _ = make(tmp_path)
    demote(store, 0)
    store.flush(5)
    demote(store, 0)  # back from L1 and evicted again: L2 still holds it
    store.host.discard(KEYS[0])
    demote(store, 0)  # L2 lost it, L3 has it
    store.flush(5)
    stats = store.stats()
    assert stats.tier(Tier.DISK).bytes_written == HEADER_BYTES + BLOCK
    assert store._writer.submitted == 1
    store.close()


def test_lookup_is_the_longest_run_of_present_keys(tmp_path):
    store, _ = make(tmp_path, host_blocks=2)
    demote(store, 0, 1, 2, 4)  # L2 keeps 2 and 4; 0 and 1 only on disk
    store.flush(5)
    assert store.lookup(KEYS[:6]) == [Tier.DISK, Tier.DISK, Tier.HOST]  # 3 is missing: the run stops
    assert store.lookup([KEYS[4], KEYS[2]]) == [Tier.HOST, Tier.HOST]
    assert store.lookup([KEYS[9]]) == []
    store.close()


def test_load_from_each_tier_promotes_disk_hits_and_counts(tmp_path):
    store, events = make(tmp_path, host_blocks=2)
    demote(store, 0, 1, 2)  # host: 1, 2
    store.flush(5)
    assert bytes(store.load(KEYS[2])) == payload(2)  # L2
    events.clear()
    assert bytes(store.load(KEYS[0])) == payload(0)  # L3, promoted: 1 leaves L2
    assert store.host.contains(KEYS[0]) and store.host.meta(KEYS[0]).parent is None
    assert ("removed", KEYS[1], KEYS[0], Tier.HOST) in events and ("stored", KEYS[0], None, Tier.HOST) in events
    assert store.disk.contains(KEYS[0])  # inclusive: the disk copy stays
    assert bytes(store.load(KEYS[1])) == payload(1)  # L3 again, with its parent from the header
    assert store.host.meta(KEYS[1]).parent == KEYS[0]
    assert store.load(KEYS[7]) is None
    s = store.stats()
    assert (s.tier(Tier.HOST).hits, s.tier(Tier.DISK).hits, s.misses) == (1, 2, 1)
    assert s.tier(Tier.HOST).bytes_read == BLOCK and s.tier(Tier.DISK).bytes_read == 2 * BLOCK
    assert s.tier(Tier.HOST).bytes_written == 5 * BLOCK  # three demotions, two promotions
    assert s.tier(Tier.HOST).blocks == 2 and s.tier(Tier.DISK).blocks == 3 and s.tier(Tier.DISK).enabled
    store.close()


def test_a_block_still_queued_for_disk_is_loadable(tmp_path, monkeypatch):
    store, _ = make(tmp_path, host_blocks=1)
    gate = threading.Event()
    real_put = store.disk.put
    monkeypatch.setattr(store.disk, "put", lambda *a: gate.wait(10) and real_put(*a))
    demote(store, 0, 1)  # 0 leaves L2 at once, its write is still queued
    assert store.lookup(KEYS[:2]) == [Tier.DISK, Tier.HOST]
    assert bytes(store.load(KEYS[0])) == payload(0)
    gate.set()
    store.close()
    assert sorted(DiskTier(tmp_path, 1 << 20, NS).keys()) == sorted(KEYS[:2])


def test_a_dropped_write_gets_another_chance_when_l2_evicts(tmp_path, monkeypatch):
    store, _ = make(tmp_path, host_blocks=2, max_pending_writes=1)
    gate, entered = threading.Event(), threading.Event()
    real_put = store.disk.put

    def put(*args):
        entered.set()
        gate.wait(10)
        return real_put(*args)

    monkeypatch.setattr(store.disk, "put", put)
    demote(store, 0)
    assert entered.wait(5)  # writing 0
    demote(store, 1)  # queued
    demote(store, 2)  # queue full: dropped
    assert store.stats().dropped_writes == 1
    gate.set()
    assert store.flush(5)
    assert set(store.disk.keys()) == {KEYS[0], KEYS[1]}
    demote(store, 3)  # L2 evicts 1, which is on disk
    assert store.flush(5)
    demote(store, 4)  # L2 evicts 2, which is not: it is written back (and fills the queue of one)
    assert store.flush(5)
    assert set(store.disk.keys()) == set(KEYS[:4])
    assert store.stats().dropped_writes == 2  # 4 found the queue full
    assert bytes(store.disk.get(KEYS[2])) == payload(2)
    store.close()


def test_host_only_and_disk_only(tmp_path):
    host_only, _ = make(tmp_path, disk=False)
    demote(host_only, 0)
    assert host_only.lookup(KEYS[:1]) == [Tier.HOST] and bytes(host_only.load(KEYS[0])) == payload(0)
    assert [t.tier for t in host_only.stats().tiers] == [Tier.HOST]
    assert host_only.close()

    disk_only, events = make(tmp_path, host_blocks=None)
    demote(disk_only, 0)
    disk_only.flush(5)
    assert disk_only.lookup(KEYS[:1]) == [Tier.DISK] and bytes(disk_only.load(KEYS[0])) == payload(0)
    assert events == [("stored", KEYS[0], None, Tier.DISK)]
    assert disk_only.close()


def test_serving_goes_on_when_the_disk_fails(tmp_path, monkeypatch, caplog):
    store, events = make(tmp_path, host_blocks=2)
    demote(store, 0)
    store.flush(5)

    def enospc(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(disk_module.os, "replace", enospc)
    demote(store, 1, 2, 3)
    store.flush(5)
    assert not store.stats().tier(Tier.DISK).enabled
    assert ("removed", KEYS[0], None, Tier.DISK) in events
    assert store.lookup(KEYS[:4]) == []  # 0 was only on disk
    assert store.lookup(KEYS[2:4]) == [Tier.HOST, Tier.HOST]
    assert bytes(store.load(KEYS[3])) == payload(3)
    demote(store, 4, 5)
    assert store.flush(5) and store.close()
    assert len([r for r in caplog.records if "turned off" in r.getMessage()]) == 1


def test_a_restarted_worker_finds_its_blocks_on_disk(tmp_path):
    store, _ = make(tmp_path)
    demote(store, *range(6))
    assert store.close()  # drains the writes
    again, _ = make(tmp_path)
    assert again.lookup(KEYS[:7]) == [Tier.DISK] * 6
    assert [bytes(again.load(k)) for k in KEYS[:6]] == [payload(i) for i in range(6)]
    assert {m.key for m in again.blocks()} == set(KEYS[:6])
    again.close()


def test_events_arrive_on_the_callers_thread_and_reproduce_the_index(tmp_path):
    threads = set()
    held: dict[tuple[bytes, Tier], bytes | None] = {}

    def on_event(kind, key, parent, tier):
        threads.add(threading.get_ident())
        if kind == "stored":
            assert (key, tier) not in held
            held[key, tier] = parent
        else:
            del held[key, tier]

    store = TieredStore(HostTier(3 * BLOCK, BLOCK), DiskTier(tmp_path, 5 * (HEADER_BYTES + BLOCK), NS), on_event=on_event)
    _open.append(store)
    demote(store, *range(10))
    store.load(KEYS[8])
    store.discard(KEYS[9])
    store.flush(5)
    assert threads == {threading.get_ident()}
    assert held == {(m.key, m.tier): m.parent for m in store.blocks()}
    store.close()


def test_close_is_safe_twice_and_everything_after_is_a_no_op(tmp_path):
    before = set(threading.enumerate())
    store, _ = make(tmp_path)
    demote(store, 0)
    assert any(t.name == "tandem-kv-disk-writer" for t in threading.enumerate())
    assert store.close() and store.close()
    assert set(threading.enumerate()) <= before
    demote(store, 1)
    assert store.load(KEYS[0]) is None and store.lookup(KEYS[:1]) == []


def test_a_tier_belongs_to_one_store(tmp_path):
    host = HostTier(BLOCK, BLOCK)
    TieredStore(host, None)
    with pytest.raises(AssertionError):
        TieredStore(host, None)


def test_damaged_blocks_are_misses_counted_per_tier(tmp_path):
    """A block changed in L2 falls through to its L3 copy; one damaged on disk is a miss: both counted."""
    store, _ = make(tmp_path, host_blocks=2)
    demote(store, 0, 1)
    store.flush(5)
    slot = store.host._lru[KEYS[0]].index
    store.host._arena[slot * BLOCK] ^= 0xFF
    got = []
    assert store.load_into(KEYS[0], got.append) is Tier.DISK and bytes(got[0]) == payload(0)
    with open(store.disk.path(KEYS[1]), "r+b") as f:
        f.seek(HEADER_BYTES + 3)
        f.write(b"\x00" if payload(1)[3] else b"\x01")
    store.host.discard(KEYS[1])
    assert store.load(KEYS[1]) is None
    s = store.stats()
    assert (s.tier(Tier.HOST).corrupt, s.tier(Tier.DISK).corrupt) == (1, 1)
    store.close()
