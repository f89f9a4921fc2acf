"""L3: blocks as files on local disk, shared safely by the workers of one host, surviving restarts.

Layout: `<dir>/<namespace hex>/<first 2 hex of key>/<key hex>.kvb`, each file a fixed header and the
payload:

    magic "TNDMKVB\\0" | version u16 | flags u16 (bit 0: has parent) | namespace digest 16B | key 16B
    | parent key 16B (zeros if none) | payload length u64 | checksum 32B     (little-endian, 100 bytes)

The checksum is blake2b (32 bytes) over the header before it and the payload, so a flipped bit
anywhere is caught. A file is published atomically: written to a temp file in the same directory
(`.<key hex>.<pid>.<random>.tmp`, a name no other writer can pick), then `os.replace`d into place,
so a reader sees the old file, the whole new one, or none. Every read checks everything it can:
a corrupt, truncated or foreign file is a miss, and is removed.

LRU within `capacity_bytes`: the index starts from a directory scan ordered by mtime, a hit touches
the file's mtime, and the oldest files go when a put brings the total over budget. Workers sharing
a directory each keep their own index; a key one of them lacks is looked up on disk (one `stat`),
and each rescans the directory once it has written a quarter of its budget, so together they
overshoot the budget by at most a fraction of it. A file that vanished under us (another worker
evicted it) is a miss, never an error.

Errors: at start, a clear ValueError naming the flag. At run time, a failed write or read (ENOSPC,
EIO, permission lost) turns the tier off with one warning; serving goes on without it.
"""

from __future__ import annotations

import hashlib
import logging
import os
import secrets
import shutil
import struct
import threading
import time
from collections import OrderedDict
from pathlib import Path

from tandem.engine.kvcache.tiers.base import BlockStore, Listener
from tandem.kvblocks.blocks import BlockMeta, EventKind, Tier
from tandem.kvblocks.keys import KEY_BYTES, Namespace, key_from_hex, key_hex

log = logging.getLogger(__name__)

MAGIC = b"TNDMKVB\x00"
FORMAT_VERSION = 1
_HEADER = struct.Struct("<8sHH16s16s16sQ32s")
HEADER_BYTES = _HEADER.size
_CHECKED = HEADER_BYTES - 32  # the header bytes the checksum covers (all but itself)
_HAS_PARENT = 1
SUFFIX = ".kvb"
TMP_SUFFIX = ".tmp"
STALE_TEMP_S = 300.0  # a temp file this old belongs to a writer that died; younger ones may be live
GIB = 1 << 30


class _Corrupt(Exception):
    def __init__(self, why: str, damaged: bool = False):
        super().__init__(why)
        self.damaged = damaged      # the block's own bytes are wrong (not: a foreign or older file)


class _Entry:
    __slots__ = ("size", "parent")

    def __init__(self, size: int, parent: bytes | None):
        self.size = size  # bytes of the file (header + payload): what the budget counts
        self.parent = parent


def _checksum(checked_header: memoryview | bytes, payload: memoryview | bytes) -> bytes:
    h = hashlib.blake2b(checked_header, digest_size=32)
    h.update(payload)
    return h.digest()


class DiskTier(BlockStore):
    """Thread-safe: the caller's thread reads (`contains`, `get`) while a writer thread `put`s."""

    tier = Tier.DISK

    def __init__(self, directory: str | os.PathLike, capacity_bytes: int, namespace: Namespace, *,
                 fsync: bool = False, listener: Listener | None = None, stale_temp_s: float = STALE_TEMP_S,
                 rescan_fraction: float = 0.25):
        if capacity_bytes < 1:
            raise ValueError(f"--kv-disk-cache-gb must be > 0, got {capacity_bytes / GIB:.3g} GiB")
        self.namespace = namespace
        self.root = Path(directory) / namespace.hex
        self._capacity = capacity_bytes
        self._fsync = fsync
        self._stale_temp_s = stale_temp_s
        self._rescan_bytes = max(1, int(capacity_bytes * rescan_fraction))
        self._lock = threading.Lock()
        self._index: OrderedDict[bytes, _Entry] = OrderedDict()  # least recently used first
        self._used = 0
        self._written_since_scan = 0
        self._enabled = True
        self._subdirs: set[str] = set()
        self.listener = None  # the start scan emits nothing: a listener begins from `keys()`
        self.bytes_written = 0
        self.bytes_read = 0
        self.evictions = 0
        self.corrupt_removed = 0
        self.damaged = 0            # ... of them, blocks whose bytes failed the checksum (or were cut short)
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            self._probe_writable()
            self._scan()
        except OSError as e:
            raise ValueError(f"--kv-disk-cache-dir {os.fspath(directory)!r} is not a usable directory: {e}") from e
        free = shutil.disk_usage(self.root).free
        if capacity_bytes > free + self._used:
            raise ValueError(
                f"--kv-disk-cache-gb {capacity_bytes / GIB:.3g} GiB is more than the filesystem of "
                f"--kv-disk-cache-dir {os.fspath(directory)!r} can hold ({(free + self._used) / GIB:.3g} GiB "
                f"free, counting this cache's own {self._used / GIB:.3g} GiB)")
        self._evict_to_budget()
        self.listener = listener

    # -- the interface --------------------------------------------------------------------------

    @property
    def capacity_bytes(self) -> int:
        return self._capacity

    @property
    def used_bytes(self) -> int:
        return self._used

    @property
    def enabled(self) -> bool:
        return self._enabled

    def path(self, key: bytes) -> Path:
        name = key_hex(key)
        return self.root / name[:2] / (name + SUFFIX)

    def contains(self, key: bytes) -> bool:
        if not self._enabled:
            return False
        with self._lock:
            if key in self._index:
                return True
        # Another worker sharing the directory may have written it.
        try:
            size = os.stat(self.path(key)).st_size
        except OSError:
            return False
        self._adopt(key, size, None)
        return True

    def get(self, key: bytes) -> memoryview | None:
        if not self._enabled:
            return None
        path = self.path(key)
        try:
            with open(path, "rb") as f:
                data = f.read()
        except FileNotFoundError:
            self._forget(key)
            return None
        except OSError as e:
            self._disable("read", e)
            return None
        try:
            parent = self._verify(key, data)
        except _Corrupt as e:
            log.debug("KV disk tier: dropping %s: %s", path, e)
            self.corrupt_removed += 1
            self.damaged += e.damaged
            self._forget(key)
            self._unlink(path)
            return None
        try:
            os.utime(path)  # the LRU clock every worker sharing the directory sees
        except OSError:
            pass  # evicted meanwhile, or the touch is refused: the bytes we hold are still good
        self.bytes_read += len(data)
        self._adopt(key, len(data), parent, touch=True)
        return memoryview(data)[HEADER_BYTES:]

    def put(self, key: bytes, parent: bytes | None, payload: bytes | bytearray | memoryview) -> bool:
        if not self._enabled:
            return False
        payload = memoryview(payload).cast("B")
        size = HEADER_BYTES + payload.nbytes
        if size > self._capacity:
            return False
        with self._lock:
            if key in self._index:
                self._index.move_to_end(key)
                return False
        path = self.path(key)
        try:
            existing = os.stat(path).st_size  # written by another worker: a block is written once
        except FileNotFoundError:
            existing = None
        except OSError as e:
            self._disable("write", e)
            return False
        if existing is not None:
            self._adopt(key, existing, parent)
            return False
        if not self._publish(path, self._header(key, parent, payload), payload):
            return False
        self.bytes_written += size
        stored = self._adopt(key, size, parent, written=True)
        if self._written_since_scan >= self._rescan_bytes:
            self.rescan()
        self._evict_to_budget()
        return stored

    def discard(self, key: bytes) -> bool:
        if not self._enabled:
            return False
        known = self._forget(key)
        self._unlink(self.path(key))
        return known

    def meta(self, key: bytes) -> BlockMeta | None:
        with self._lock:
            entry = self._index.get(key)
            return None if entry is None else BlockMeta(key, entry.parent, Tier.DISK)

    def keys(self) -> list[bytes]:
        with self._lock:
            return list(self._index)

    def __len__(self) -> int:
        return len(self._index)

    def close(self) -> None:
        # The files stay: they are the next start's warm cache.
        with self._lock:
            self._enabled = False
            self._index.clear()
            self._used = 0

    def rescan(self) -> None:
        """Rebuild the index from the directory (what other workers wrote or evicted), oldest first."""
        if not self._enabled:
            return
        try:
            self._scan()
        except OSError as e:
            self._disable("scan", e)

    # -- files ----------------------------------------------------------------------------------

    def _header(self, key: bytes, parent: bytes | None, payload: memoryview) -> bytes:
        assert len(key) == KEY_BYTES and (parent is None or len(parent) == KEY_BYTES)
        head = _HEADER.pack(MAGIC, FORMAT_VERSION, _HAS_PARENT if parent is not None else 0,
                            self.namespace.digest, key, parent or bytes(KEY_BYTES), payload.nbytes, bytes(32))
        return head[:_CHECKED] + _checksum(head[:_CHECKED], payload)

    def _verify(self, key: bytes, data: bytes) -> bytes | None:
        """The block's parent if `data` is a whole, intact block of `key` in this namespace."""
        if len(data) < HEADER_BYTES:
            raise _Corrupt(f"truncated: {len(data)} bytes, less than a header", damaged=True)
        magic, version, flags, ns, stored_key, parent, length, checksum = _HEADER.unpack_from(data)
        if magic != MAGIC:
            raise _Corrupt("not a KV block (bad magic)")
        if version != FORMAT_VERSION:
            raise _Corrupt(f"format version {version}, expected {FORMAT_VERSION}")
        if ns != self.namespace.digest:
            raise _Corrupt("written for another model, dtype or page layout")
        if stored_key != key:
            raise _Corrupt("header names another key")
        if length != len(data) - HEADER_BYTES:
            raise _Corrupt(f"payload is {len(data) - HEADER_BYTES} bytes, header says {length}", damaged=True)
        view = memoryview(data)
        if _checksum(view[:_CHECKED], view[HEADER_BYTES:]) != checksum:
            raise _Corrupt("checksum mismatch", damaged=True)
        return parent if flags & _HAS_PARENT else None

    def _publish(self, path: Path, header: bytes, payload: memoryview) -> bool:
        sub = path.parent
        tmp = sub / f".{path.stem}.{os.getpid()}.{secrets.token_hex(4)}{TMP_SUFFIX}"
        try:
            if sub.name not in self._subdirs:
                sub.mkdir(exist_ok=True)
                self._subdirs.add(sub.name)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            with os.fdopen(fd, "wb") as f:
                f.write(header)
                f.write(payload)
                f.flush()
                if self._fsync:
                    os.fsync(f.fileno())
            os.replace(tmp, path)
            return True
        except OSError as e:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            self._disable("write", e)
            return False

    def _unlink(self, path: Path) -> None:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass  # another worker got there first
        except OSError as e:
            self._disable("remove", e)

    def _probe_writable(self) -> None:
        probe = self.root / f".probe.{os.getpid()}.{secrets.token_hex(4)}{TMP_SUFFIX}"
        with open(probe, "xb") as f:
            f.write(b"\0")
        os.unlink(probe)

    def _scan(self) -> None:
        found: list[tuple[float, str, bytes, int]] = []
        now = time.time()
        with os.scandir(self.root) as it:
            tops = list(it)
        for top in tops:
            if top.is_dir(follow_symlinks=False) and len(top.name) == 2:
                try:
                    entries = list(os.scandir(top.path))
                except FileNotFoundError:
                    continue
                for e in entries:
                    if e.name.endswith(SUFFIX):
                        key = key_from_hex(e.name[:-len(SUFFIX)])
                        if key is None or not e.name.startswith(top.name):
                            continue  # not ours: leave it alone
                        try:
                            st = e.stat(follow_symlinks=False)
                        except FileNotFoundError:
                            continue
                        found.append((st.st_mtime, e.name, key, st.st_size))
                    else:
                        self._clean_temp(e, now)
            else:
                self._clean_temp(top, now)
        found.sort()
        with self._lock:
            old = self._index
            self._index = OrderedDict(
                (key, _Entry(size, old[key].parent if key in old else None)) for _, _, key, size in found)
            self._used = sum(e.size for e in self._index.values())
            self._written_since_scan = 0
            added = [(key, self._index[key].parent) for key in self._index if key not in old]
            gone = [(key, entry.parent) for key, entry in old.items() if key not in self._index]
        for key, parent in added:
            self._event("stored", key, parent)
        for key, parent in gone:
            self._event("removed", key, parent)

    def _clean_temp(self, entry: os.DirEntry, now: float) -> None:
        # Only old ones: a young temp file may be another worker's write in progress.
        if not (entry.name.startswith(".") and entry.name.endswith(TMP_SUFFIX)):
            return
        try:
            if now - entry.stat(follow_symlinks=False).st_mtime > self._stale_temp_s:
                os.unlink(entry.path)
        except FileNotFoundError:
            pass

    # -- the index ------------------------------------------------------------------------------

    def _adopt(self, key: bytes, size: int, parent: bytes | None, *, touch: bool = False,
               written: bool = False) -> bool:
        """Record a block that is on disk; True when it was not in the index."""
        with self._lock:
            if not self._enabled:
                return False
            if written:
                self._written_since_scan += size
            entry = self._index.get(key)
            if entry is not None:
                if parent is not None:
                    entry.parent = parent
                if touch:
                    self._index.move_to_end(key)
                return False
            self._index[key] = _Entry(size, parent)
            self._used += size
        self._event("stored", key, parent)
        return True

    def _forget(self, key: bytes) -> bool:
        with self._lock:
            entry = self._index.pop(key, None)
            if entry is None:
                return False
            self._used -= entry.size
        self._event("removed", key, entry.parent)
        return True

    def _evict_to_budget(self) -> None:
        while True:
            with self._lock:
                if self._used <= self._capacity or not self._index:
                    return
                key, entry = self._index.popitem(last=False)
                self._used -= entry.size
                self.evictions += 1
            self._unlink(self.path(key))
            self._event("removed", key, entry.parent)
            if not self._enabled:
                return

    def _disable(self, what: str, error: OSError) -> None:
        with self._lock:
            if not self._enabled:
                return
            self._enabled = False
            gone = list(self._index.items())
            self._index.clear()
            self._used = 0
        log.warning("KV disk tier %s turned off after a %s error (%s); serving goes on without it",
                    self.root, what, error)
        for key, entry in gone:
            self._event("removed", key, entry.parent)

    def _event(self, kind: EventKind, key: bytes, parent: bytes | None) -> None:
        self._emit(kind, BlockMeta(key, parent, Tier.DISK))
