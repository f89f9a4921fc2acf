from __future__ import annotations

import threading

import pytest

from tandem.engine.kvcache.tiers.disk import DiskTier
from tandem.engine.kvcache.tiers.writer import WriteBehind
from tandem.kvblocks.keys import Namespace, block_hashes

NS = Namespace(model="tandem-test-model", dtype="bfloat16", page_size=4, num_layers=2, kv_heads=1, head_dim=8)
KEYS = block_hashes(NS, list(range(4 * 16)))
NAME = "tandem-kv-disk-writer"


def writer_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == NAME]


@pytest.fixture
def disk(tmp_path):
    d = DiskTier(tmp_path, 1 << 20, NS)
    yield d
    d.close()


class Gate:
    """Holds the writer thread inside `disk.put` until opened."""

    def __init__(self, disk: DiskTier, monkeypatch):
        self.entered = threading.Event()
        self.open = threading.Event()
        real_put = disk.put

        def put(key, parent, payload):
            self.entered.set()
            assert self.open.wait(10)
            return real_put(key, parent, payload)

        monkeypatch.setattr(disk, "put", put)


def test_writes_land_on_disk_and_close_leaves_no_thread(disk):
    w = WriteBehind(disk)
    assert writer_threads() == []  # idle until the first write
    assert w.submit(KEYS[0], None, b"block zero")
    assert w.submit(KEYS[1], KEYS[0], b"block one")
    assert w.flush(5)
    assert bytes(disk.get(KEYS[1])) == b"block one" and disk.meta(KEYS[1]).parent == KEYS[0]
    assert (w.submitted, w.written, w.dropped, w.queued) == (2, 2, 0, 0)
    assert len(writer_threads()) == 1
    assert w.close() and w.close()
    assert writer_threads() == []
    assert not w.submit(KEYS[2], None, b"late")  # closed: refused


def test_close_without_writes_starts_nothing(disk):
    w = WriteBehind(disk)
    assert w.close()
    assert writer_threads() == []


def test_a_full_queue_drops_and_counts_never_blocks(disk, monkeypatch):
    gate = Gate(disk, monkeypatch)
    w = WriteBehind(disk, max_pending=2)
    w.submit(KEYS[0], None, b"0")
    assert gate.entered.wait(5)  # the thread holds 0; the queue is empty again
    assert w.submit(KEYS[1], None, b"1") and w.submit(KEYS[2], None, b"2")
    assert not w.submit(KEYS[3], None, b"3")  # full: dropped at once
    assert not w.submit(KEYS[1], None, b"1")  # already queued: not a drop
    assert w.dropped == 1 and w.queued == 3
    gate.open.set()
    assert w.close(5)
    assert set(disk.keys()) == {KEYS[0], KEYS[1], KEYS[2]}
    assert writer_threads() == []


def test_pending_writes_stay_readable_and_can_be_cancelled(disk, monkeypatch):
    gate = Gate(disk, monkeypatch)
    w = WriteBehind(disk)
    buf = bytearray(b"mutable")
    w.submit(KEYS[0], None, b"busy")
    assert gate.entered.wait(5)
    w.submit(KEYS[1], KEYS[0], buf)
    buf[:] = b"changed"  # the writer copied it when it was queued
    assert w.pending(KEYS[0]) == (None, b"busy")
    assert w.pending(KEYS[1]) == (KEYS[0], b"mutable")
    w.submit(KEYS[2], None, b"two")
    assert w.cancel(KEYS[2]) and not w.cancel(KEYS[2]) and not w.cancel(KEYS[0])
    gate.open.set()
    assert w.flush(5)
    assert w.pending(KEYS[1]) is None
    assert bytes(disk.get(KEYS[1])) == b"mutable" and disk.get(KEYS[2]) is None
    w.close()


def test_close_abandons_what_it_cannot_finish_in_time(disk, monkeypatch):
    gate = Gate(disk, monkeypatch)
    w = WriteBehind(disk)
    for i in range(4):
        w.submit(KEYS[i], None, b"x")
    assert gate.entered.wait(5)
    threading.Timer(0.3, gate.open.set).start()  # the stuck write finishes after close gave up waiting
    assert not w.close(timeout=0.05)
    assert w.close()  # twice is fine
    assert writer_threads() == []
    assert disk.keys() == [KEYS[0]]  # the write in progress completed; the queued ones were abandoned


def test_a_bug_in_one_write_does_not_stop_the_thread(disk, monkeypatch, caplog):
    real_put = disk.put

    def put(key, parent, payload):
        if key == KEYS[0]:
            raise RuntimeError("bug")
        return real_put(key, parent, payload)

    monkeypatch.setattr(disk, "put", put)
    w = WriteBehind(disk)
    w.submit(KEYS[0], None, b"0")
    w.submit(KEYS[1], None, b"1")
    assert w.flush(5)
    assert (w.failed, w.written) == (1, 1) and disk.contains(KEYS[1])
    assert "failed" in caplog.text
    w.close()
