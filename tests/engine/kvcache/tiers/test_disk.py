from __future__ import annotations

import errno
import logging
import multiprocessing
import os
import random
import shutil
import time
from dataclasses import replace
from pathlib import Path

import pytest

from tandem.engine.kvcache.tiers import disk as disk_module
from tandem.engine.kvcache.tiers.disk import HEADER_BYTES, DiskTier
from tandem.kvblocks.blocks import Tier
from tandem.kvblocks.keys import Namespace, block_hashes

NS = Namespace(model="tandem-test-model", dtype="bfloat16", page_size=4, num_layers=2, kv_heads=1, head_dim=8)
KEYS = block_hashes(NS, list(range(4 * 64)))
BLOCK = 256
FILE = HEADER_BYTES + BLOCK
MB = 1 << 20


def payload(i: int, n: int = BLOCK) -> bytes:
    return random.Random(i).randbytes(n)


def tier(path: Path, capacity: int = MB, **kw) -> DiskTier:
    return DiskTier(path, capacity, NS, **kw)


def test_round_trip_layout_and_parent(tmp_path):
    d = tier(tmp_path)
    assert d.put(KEYS[1], KEYS[0], payload(1))
    assert not d.put(KEYS[1], KEYS[0], payload(1))  # written once
    path = tmp_path / NS.hex / KEYS[1].hex()[:2] / (KEYS[1].hex() + ".kvb")
    assert d.path(KEYS[1]) == path and path.stat().st_size == FILE
    assert bytes(d.get(KEYS[1])) == payload(1)
    assert d.meta(KEYS[1]).parent == KEYS[0] and d.meta(KEYS[1]).tier == Tier.DISK
    assert d.get(KEYS[2]) is None and not d.contains(KEYS[2])
    assert (d.used_bytes, d.bytes_written, d.bytes_read) == (FILE, FILE, FILE)
    assert not list(tmp_path.rglob("*.tmp"))


def test_a_restarted_tier_starts_warm(tmp_path):
    d = tier(tmp_path)
    for i in range(3):
        d.put(KEYS[i], KEYS[i - 1] if i else None, payload(i))
    d.close()
    d.close()
    again = tier(tmp_path)
    assert sorted(again.keys()) == sorted(KEYS[:3]) and again.used_bytes == 3 * FILE
    assert again.meta(KEYS[2]).parent is None  # a scan reads no headers...
    assert bytes(again.get(KEYS[2])) == payload(2)
    assert again.meta(KEYS[2]).parent == KEYS[1]  # ...a read does


def test_another_namespace_sees_nothing(tmp_path):
    tier(tmp_path).put(KEYS[0], None, payload(0))
    other = DiskTier(tmp_path, MB, replace(NS, page_size=8))
    assert other.keys() == [] and not other.contains(KEYS[0]) and other.get(KEYS[0]) is None


def flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("damage", ["payload byte", "header byte", "parent byte", "truncated", "header only",
                                    "empty", "version"])
def test_a_damaged_block_is_a_miss_and_is_removed(tmp_path, damage):
    d = tier(tmp_path)
    d.put(KEYS[1], KEYS[0], payload(1))
    path = d.path(KEYS[1])
    if damage == "payload byte":
        flip(path, HEADER_BYTES + 100)
    elif damage == "header byte":
        flip(path, 0)
    elif damage == "parent byte":
        flip(path, 8 + 2 + 2 + 16 + 16)  # not compared, but covered by the checksum
    elif damage == "version":
        flip(path, 8)
    elif damage == "truncated":
        path.write_bytes(path.read_bytes()[:-1])
    elif damage == "header only":
        path.write_bytes(path.read_bytes()[:HEADER_BYTES])
    else:
        path.write_bytes(b"")
    assert d.get(KEYS[1]) is None
    assert not path.exists() and not d.contains(KEYS[1]) and d.used_bytes == 0
    assert d.corrupt_removed == 1 and d.enabled


def test_a_foreign_or_misplaced_file_is_a_miss_and_is_removed(tmp_path):
    foreign = DiskTier(tmp_path / "other", MB, replace(NS, dtype="float32"))
    foreign.put(KEYS[0], None, payload(0))
    d = tier(tmp_path / "ours")
    d.path(KEYS[0]).parent.mkdir(parents=True)
    shutil.copy(foreign.path(KEYS[0]), d.path(KEYS[0]))  # right name, another model's bytes
    assert d.contains(KEYS[0])  # a name is only a hint...
    assert d.get(KEYS[0]) is None and not d.path(KEYS[0]).exists()  # ...the header decides

    d.put(KEYS[1], None, payload(1))
    d.path(KEYS[2]).parent.mkdir(exist_ok=True)
    shutil.copy(d.path(KEYS[1]), d.path(KEYS[2]))  # a whole, valid block under the wrong key
    assert d.get(KEYS[2]) is None and not d.path(KEYS[2]).exists()
    assert bytes(d.get(KEYS[1])) == payload(1)


def test_budget_evicts_least_recently_used_first(tmp_path):
    removed = []
    d = tier(tmp_path, capacity=3 * FILE, listener=lambda kind, meta: kind == "removed" and removed.append(meta.key))
    for i in range(3):
        d.put(KEYS[i], None, payload(i))
    d.get(KEYS[0])  # touched: 1 is now the oldest
    d.put(KEYS[3], None, payload(3))
    assert removed == [KEYS[1]] and not d.path(KEYS[1]).exists()
    assert set(d.keys()) == {KEYS[0], KEYS[2], KEYS[3]} and d.used_bytes == 3 * FILE
    assert d.evictions == 1
    assert not d.put(KEYS[4], None, bytes(3 * FILE))  # can never fit: refused, nothing evicted
    assert d.used_bytes == 3 * FILE


def test_a_restart_with_a_smaller_budget_keeps_the_newest_by_mtime(tmp_path):
    d = tier(tmp_path)
    for i in range(4):
        d.put(KEYS[i], None, payload(i))
    now = time.time()
    for age, i in enumerate([2, 0, 3, 1]):  # 1 is the oldest, 2 the newest
        os.utime(d.path(KEYS[i]), (now - 100 * age, now - 100 * age))
    smaller = tier(tmp_path, capacity=2 * FILE)
    assert smaller.keys() == [KEYS[0], KEYS[2]]  # oldest first
    assert not d.path(KEYS[1]).exists() and not d.path(KEYS[3]).exists()


def test_a_hit_touches_the_files_mtime(tmp_path):
    d = tier(tmp_path)
    d.put(KEYS[0], None, payload(0))
    os.utime(d.path(KEYS[0]), (1, 1))
    d.get(KEYS[0])
    assert d.path(KEYS[0]).stat().st_mtime > time.time() - 60


def test_stale_temp_files_go_at_start_young_ones_stay(tmp_path):
    tier(tmp_path).put(KEYS[0], None, payload(0))
    sub = tmp_path / NS.hex / KEYS[0].hex()[:2]
    old, young = sub / f".{KEYS[0].hex()}.1.aaaa.tmp", sub / f".{KEYS[0].hex()}.2.bbbb.tmp"
    old.write_bytes(b"half a blo")
    young.write_bytes(b"half a blo")
    os.utime(old, (time.time() - 3600,) * 2)
    tier(tmp_path)
    assert not old.exists() and young.exists()


def test_unusable_directory_or_budget_is_a_clear_start_error(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    with pytest.raises(ValueError, match="--kv-disk-cache-dir"):
        tier(blocker / "cache")
    with pytest.raises(ValueError, match="--kv-disk-cache-gb"):
        tier(tmp_path, capacity=shutil.disk_usage(tmp_path).free + (1 << 40))
    with pytest.raises(ValueError, match="--kv-disk-cache-gb"):
        tier(tmp_path, capacity=0)


class _FullFile:
    """A file whose writes fail as on a full disk."""

    def __init__(self, f):
        self._f = f

    def write(self, data):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._f.close()


def test_a_full_disk_turns_the_tier_off_with_one_warning(tmp_path, monkeypatch, caplog):
    events = []
    d = tier(tmp_path, listener=lambda kind, meta: events.append((kind, meta.key)))
    d.put(KEYS[0], None, payload(0))
    real_fdopen = os.fdopen
    monkeypatch.setattr(disk_module.os, "fdopen", lambda fd, mode: _FullFile(real_fdopen(fd, mode)))
    with caplog.at_level(logging.WARNING, logger=disk_module.__name__):
        assert not d.put(KEYS[1], None, payload(1))
        assert not d.enabled
        assert not d.put(KEYS[2], None, payload(2))
        assert d.get(KEYS[0]) is None and not d.contains(KEYS[0]) and not d.discard(KEYS[0])
        d.rescan()
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "turned off" in warnings[0].getMessage()
    assert "No space" in warnings[0].getMessage()
    assert not list(tmp_path.rglob("*.tmp"))  # the failed write left nothing behind
    assert d.path(KEYS[0]).exists()  # the blocks stay for the next start
    assert events == [("stored", KEYS[0]), ("removed", KEYS[0])] and d.keys() == []
    monkeypatch.undo()
    assert tier(tmp_path).keys() == [KEYS[0]]


def test_a_read_error_turns_the_tier_off(tmp_path, monkeypatch, caplog):
    d = tier(tmp_path)
    d.put(KEYS[0], None, payload(0))

    def eio(*args, **kwargs):
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    monkeypatch.setattr(disk_module, "open", eio, raising=False)
    with caplog.at_level(logging.WARNING, logger=disk_module.__name__):
        assert d.get(KEYS[0]) is None
        assert d.get(KEYS[0]) is None
    assert not d.enabled and len(caplog.records) == 1


def test_two_tiers_share_a_directory(tmp_path):
    a, b = tier(tmp_path), tier(tmp_path)
    a.put(KEYS[0], None, payload(0))
    assert b.contains(KEYS[0]) and bytes(b.get(KEYS[0])) == payload(0)
    assert not b.put(KEYS[0], None, payload(0))  # already on disk: not written again
    a.discard(KEYS[0])
    assert b.get(KEYS[0]) is None and b.enabled  # gone under b's feet: a miss, not an error
    assert KEYS[0] not in b.keys()


def test_a_rescan_learns_what_another_worker_wrote_and_evicted(tmp_path):
    events = []
    a = tier(tmp_path, listener=lambda kind, meta: events.append((kind, meta.key)))
    b = tier(tmp_path)
    a.put(KEYS[0], None, payload(0))
    b.put(KEYS[1], None, payload(1))
    b.discard(KEYS[0])
    a.rescan()
    assert a.keys() == [KEYS[1]]
    assert events == [("stored", KEYS[0]), ("stored", KEYS[1]), ("removed", KEYS[0])]


def _hammer(directory: str, seed: int, seconds: float, out) -> None:
    """One worker: write and read a shared set of keys under a budget that forces evictions."""
    d = DiskTier(directory, 24 * (HEADER_BYTES + 64 * 1024), NS)
    rng = random.Random(seed)
    hits = bad = writes = 0
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        i = rng.randrange(48)
        if rng.random() < 0.5:
            writes += d.put(KEYS[i], None, payload(i, 64 * 1024))
        else:
            got = d.get(KEYS[i])
            if got is not None:
                hits += 1
                bad += bytes(got) != payload(i, 64 * 1024)
    out.put((hits, bad, writes, d.corrupt_removed, d.enabled))


def test_two_processes_never_read_half_a_block(tmp_path):
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_hammer, args=(str(tmp_path), seed, 1.5, out)) for seed in (1, 2)]
    for p in procs:
        p.start()
    results = [out.get(timeout=60) for _ in procs]
    for p in procs:
        p.join(timeout=30)
        assert p.exitcode == 0
    for hits, bad, writes, corrupt, enabled in results:
        assert bad == 0 and corrupt == 0 and enabled
        assert hits > 0 and writes > 0
    assert not list(tmp_path.rglob("*.tmp"))
    # Whatever is left is whole: a fresh tier reads every file back intact.
    d = tier(tmp_path, capacity=64 * MB)
    for key in d.keys():
        assert bytes(d.get(key)) == payload(KEYS.index(key), 64 * 1024)
