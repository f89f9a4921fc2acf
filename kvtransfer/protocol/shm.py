"""shm data path (same host only): D's pool lives in POSIX shared memory and P copies pages into it.

D's receiver creates `/dev/shm/tandem-kv-<worker>-<pid>-<random>`: a 4 KiB header (magic, a random
nonce, owner pid) followed by the pool, reserved up front with `posix_fallocate` (so a full /dev/shm
fails at start-up rather than with SIGBUS later) and zero-filled. P maps the file once per peer and, in
its sender thread, copies each run with one strided copy over all layers and K/V; the control frames
(hello, WROTE note, aux record, abort) still travel over the receiver's TCP control socket, after the
copies, so when D sees the aux record the pages are there.

Lifetime: D's `close()` unlinks the file (mappings stay valid until their tensors are freed); so does
interpreter exit, or the segment being garbage-collected, if `close()` never ran. A D killed with
SIGKILL leaks its file; the next segment created in the same directory removes it first
(`cleanup_stale_segments()`). A file counts as stale only when both say its owner is gone: the pid in
its name is not alive in this pid namespace, and nobody holds the `flock` that the owner keeps on it
for its whole life (locks are per open file, so this also protects a live owner in another pid
namespace that shares /dev/shm).
"""

from __future__ import annotations

import dataclasses
import fcntl
import logging
import mmap
import os
import re
import secrets
import socket
import struct
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from tandem.kvtransfer.base import PoolLayout, TransferError
from tandem.kvtransfer.datapath import Link, ReceiverPath, SenderPath, flip_byte
from tandem.kvtransfer.protocol import checksum
from tandem.kvtransfer.protocol.runs import split_runs
from tandem.kvtransfer.protocol.wire import Kind, ReceiverMetadata, wrote_body

SHM_DIR = "/dev/shm"
PREFIX = "tandem-kv-"
HEADER_BYTES = 4096
_MAGIC = b"TANDEMKV"
_HEAD = struct.Struct("<8s16sQ")      # magic, nonce, owner pid

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ShmInfo:
    """The "shm" entry of a receiver's metadata."""
    path: str
    size: int
    offset: int
    nonce: str
    hostname: str

    @classmethod
    def from_metadata(cls, meta: ReceiverMetadata) -> ShmInfo:
        entry = meta.entries.get("shm")
        if entry is None:
            raise TransferError("no segment in the metadata")
        try:
            return cls(**entry)
        except TypeError as e:
            raise TransferError(f"bad shm entry in the metadata: {e}") from e


def _pool_bytes(layout: PoolLayout) -> int:
    return layout.page_bytes * layout.num_pages * layout.num_layers * 2


class Segment:
    """A shared-memory file holding one pool, mapped MAP_SHARED in this process.

    The creating process owns the file: it holds an exclusive `flock` on it until `unlink()`, which
    runs at the latest when the Segment is garbage-collected or the interpreter exits."""

    def __init__(self, path: str, mm: mmap.mmap, nonce: bytes, owner_fd: int | None = None):
        self.path = path
        self._mm = mm
        self._nonce = nonce
        self._unlink = weakref.finalize(self, _release, path, owner_fd) if owner_fd is not None else None

    @classmethod
    def create(cls, layout: PoolLayout, worker_id: str, directory: str = SHM_DIR) -> Segment:
        """Create and map a new segment, after removing the stale ones of dead workers in `directory`."""
        for path in cleanup_stale_segments(directory):
            log.warning("removed the shared-memory KV segment %s of a worker that is gone", path)
        safe = re.sub(r"[^A-Za-z0-9_.]", "_", worker_id)[:64]
        path = os.path.join(directory, f"{PREFIX}{safe}-{os.getpid()}-{secrets.token_hex(4)}")
        size = HEADER_BYTES + _pool_bytes(layout)
        nonce = secrets.token_bytes(16)
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        except OSError as e:
            raise TransferError(f"cannot create shared-memory segment {path}: {e}") from e
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)   # held until unlink: "the owner is alive"
            os.posix_fallocate(fd, 0, size)
            mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except OSError as e:
            _release(path, fd)
            raise TransferError(f"cannot reserve {size} bytes of shared memory in {directory}: {e}") from e
        mm[:_HEAD.size] = _HEAD.pack(_MAGIC, nonce, os.getpid())
        return cls(path, mm, nonce, owner_fd=fd)

    @classmethod
    def open(cls, info: ShmInfo, layout: PoolLayout) -> Segment:
        """Map a peer's segment; TransferError if it is on another host or is not the advertised one."""
        if info.hostname != socket.gethostname():
            raise TransferError(f"shm segment is on host {info.hostname!r}, this is {socket.gethostname()!r}")
        if info.size != HEADER_BYTES + _pool_bytes(layout) or info.offset != HEADER_BYTES:
            raise TransferError(f"shm segment size {info.size} does not match its layout")
        try:
            fd = os.open(info.path, os.O_RDWR)
        except OSError as e:
            raise TransferError(f"cannot open shm segment {info.path}: {e}") from e
        try:
            if os.fstat(fd).st_size != info.size:
                raise TransferError(f"shm segment {info.path} has the wrong size")
            mm = mmap.mmap(fd, info.size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        magic, nonce, _ = _HEAD.unpack(mm[:_HEAD.size])
        if magic != _MAGIC or nonce.hex() != info.nonce:
            raise TransferError(f"{info.path} is not the advertised segment (another /dev/shm?)")
        return cls(info.path, mm, nonce)

    def info(self) -> ShmInfo:
        return ShmInfo(path=self.path, size=len(self._mm), offset=HEADER_BYTES, nonce=self._nonce.hex(),
                       hostname=socket.gethostname())

    def tensor(self, layout: PoolLayout) -> torch.Tensor:
        """The pool as `layout.shape`. The mapping lives as long as any tensor viewing it; it is never
        unmapped explicitly (an explicit munmap under a live view would crash the process)."""
        raw = torch.frombuffer(self._mm, dtype=torch.uint8, count=_pool_bytes(layout), offset=HEADER_BYTES)
        return raw.view(layout.torch_dtype).view(layout.shape)

    def unlink(self) -> None:
        """Owner: remove the file and drop the lock (idempotent); a no-op on a peer's mapping."""
        if self._unlink is not None:
            self._unlink()


def _release(path: str, fd: int) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    finally:
        os.close(fd)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True                       # someone else's live process
    return True


def cleanup_stale_segments(directory: str = SHM_DIR) -> list[str]:
    """Remove segments whose owner is gone (its pid is dead and nobody holds the file's lock);
    returns the paths removed. Files that are not Tandem segments are never touched."""
    removed = []
    try:
        names = os.listdir(directory)
    except OSError:
        return removed
    for name in names:
        if not name.startswith(PREFIX):
            continue
        try:
            pid = int(name.rsplit("-", 2)[1])
        except (IndexError, ValueError):
            continue
        if _pid_alive(pid):
            continue
        path = os.path.join(directory, name)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError:
            continue                      # gone already, a symlink, or not ours to open
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.unlink(path)               # unlinked while we hold the lock: no owner can be mid-create
            removed.append(path)
        except OSError:
            pass                          # locked: a live owner (another pid namespace); or not ours
        finally:
            os.close(fd)
    return removed


class ShmReceiverPath(ReceiverPath):
    """D side: the pool lives in a shared-memory segment that senders on this host map."""

    kind = "shm"
    one_sided = True

    def __init__(self, layout: PoolLayout, host: str, worker_id: str):
        self._layout = layout
        self._worker_id = worker_id
        self._segment: Segment | None = None

    def memory(self) -> torch.Tensor:
        self._segment = Segment.create(self._layout, self._worker_id)
        return self._segment.tensor(self._layout)

    def attach(self, pool: torch.Tensor, busy: Callable[[], bool]) -> dict:
        assert self._segment is not None, "another data path provided the pool"
        return dataclasses.asdict(self._segment.info())

    def shutdown(self) -> None:
        if self._segment is not None:
            self._segment.unlink()      # peers' and our mappings stay valid after the unlink


class ShmSenderPath(SenderPath):
    """P side: maps each peer's segment once, if the peer is on this host."""

    kind = "shm"

    def __init__(self, layout: PoolLayout, worker_id: str):
        self._layout = layout
        self._src: torch.Tensor | None = None

    def attach(self, pool: torch.Tensor) -> None:
        self._src = pool

    def link(self, peer_id: str, meta: ReceiverMetadata) -> ShmLink:
        return ShmLink(self._src, self._layout, Segment.open(ShmInfo.from_metadata(meta), meta.layout), meta.layout)


class ShmLink(Link):
    """P side: copies page runs into the peer's mapped pool, then tells D with a WROTE note."""

    kind = "shm"

    def __init__(self, src: torch.Tensor, src_layout: PoolLayout, segment: Segment, dst_layout: PoolLayout):
        self._src = src
        self._segment = segment
        self._dst = segment.tensor(dst_layout)
        self._src_layout, self._layout = src_layout, dst_layout
        self._bytes_per_page = dst_layout.geometry().page_bytes

    def write(self, room: int, runs: np.ndarray, stop: Callable[[], bool], corrupt: bool = False) -> int:
        """One copy per run over all layers and K/V (strided in a layer-first pool); stops between runs
        once `stop()` is true."""
        return self._copy(room, runs, stop, corrupt, None)[0]

    def sums_inline(self) -> tuple[str, ...]:
        return ("crc32c",) if checksum.native_crc32c() else ()

    def write_summed(self, room: int, runs: np.ndarray, stop: Callable[[], bool], algorithm: str,
                     corrupt: bool = False) -> tuple[int, int]:
        """`write` of one piece by the native copy, which hashes each chunk of the source right after
        copying it (in cache): the CRC-32C in wire order. A piece is copied whole."""
        return self._copy(room, runs, stop, corrupt, checksum.native_crc32c())

    def _copy(self, room: int, runs: np.ndarray, stop: Callable[[], bool], corrupt: bool, crc) -> tuple[int, int]:
        """The native copy where it is built (hashing as it goes with `crc`; unchecked, in pieces with
        `stop()` looked at between them), else one torch copy per run."""
        src, dst = self._src, self._dst
        started = time.monotonic()
        value = 0
        done: list[np.ndarray] = []
        native = crc or _native_copy()
        if native is not None:
            geometry, src_geometry = self._layout.geometry(), self._src_layout.geometry()
            pieces = [runs] if crc is not None else split_runs(runs, max(1, checksum.PIECE_BYTES // self._bytes_per_page))
            for piece in pieces:
                if crc is None and stop():
                    break
                value = native.copy_runs(dst, src, geometry, src_geometry, piece, crc is not None) or 0
                done.append(piece)
        else:
            by_page_src, by_page_dst = self._src_layout.by_page(src), self._layout.by_page(dst)
            for i, (s, d, n) in enumerate(runs.tolist()):
                if stop():
                    break
                by_page_dst[d:d + n].copy_(by_page_src[s:s + n])
                done.append(runs[i:i + 1])
        written = np.concatenate(done) if done else runs[:0]
        if corrupt and len(written):    # in D's memory, after the copy
            flip_byte(self._layout.by_page(dst)[int(runs[0, 1]), 0, 0].view(-1).view(torch.uint8).numpy())
        nbytes = int(written[:, 2].sum()) * self._bytes_per_page
        # Same host, so CLOCK_MONOTONIC is shared: D times the room from the copy's start.
        self.ch.send(Kind.WROTE, room, wrote_body(started, written), payload_len=nbytes)
        return nbytes, value

    def close(self) -> None:
        self._dst = None          # the mapping goes when the last view is freed
        self._segment = None


def _native_copy():
    """The compiled copy (kvtransfer/native, with the CRC-32C library), or None where it is not built."""
    from tandem.kvtransfer.native import crc32c  # built once per process; not needed to import this module

    return crc32c()
