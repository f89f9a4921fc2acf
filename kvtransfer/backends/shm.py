"""shm data path (same host only): D's pool lives in POSIX shared memory and P copies pages into it.

D's receiver creates `/dev/shm/tandem-kv-<worker>-<pid>-<random>`: a 4 KiB header (magic, a random
nonce, owner pid) followed by the pool, reserved up front with `posix_fallocate` (so a full /dev/shm
fails at start-up rather than with SIGBUS later) and zero-filled. P maps the file once per peer and, in
its sender thread, copies each run with one strided copy over all layers and K/V; the control frames
(hello, WROTE note, aux record, abort) still travel over the receiver's TCP control socket, after the
copies, so when D sees the aux record the pages are there.

Lifetime: D's `close()` unlinks the file (mappings stay valid until their tensors are freed). A D
killed with SIGKILL leaks its file: `cleanup_stale_segments()` removes files whose owner pid is gone
(pids are checked in this pid namespace, so run it where the workers run).
"""

from __future__ import annotations

import mmap
import os
import re
import secrets
import socket
import struct
import time
from collections.abc import Callable

import numpy as np
import torch

from kvtransfer.base import PoolLayout, TransferError
from kvtransfer.wire import WROTE_BODY, Channel, Kind, ShmInfo

SHM_DIR = "/dev/shm"
PREFIX = "tandem-kv-"
HEADER_BYTES = 4096
_MAGIC = b"TANDEMKV"
_HEAD = struct.Struct("<8s16sQ")      # magic, nonce, owner pid


def _pool_bytes(layout: PoolLayout) -> int:
    return layout.page_bytes * layout.num_pages * layout.num_layers * 2


class Segment:
    """A shared-memory file holding one pool, mapped MAP_SHARED in this process."""

    def __init__(self, path: str, mm: mmap.mmap, nonce: bytes, owner: bool):
        self.path = path
        self._mm = mm
        self._nonce = nonce
        self._owner = owner

    @classmethod
    def create(cls, layout: PoolLayout, worker_id: str, directory: str = SHM_DIR) -> Segment:
        safe = re.sub(r"[^A-Za-z0-9_.]", "_", worker_id)[:64]
        path = os.path.join(directory, f"{PREFIX}{safe}-{os.getpid()}-{secrets.token_hex(4)}")
        size = HEADER_BYTES + _pool_bytes(layout)
        nonce = secrets.token_bytes(16)
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        except OSError as e:
            raise TransferError(f"cannot create shared-memory segment {path}: {e}") from e
        try:
            os.posix_fallocate(fd, 0, size)
            mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except OSError as e:
            os.unlink(path)
            raise TransferError(f"cannot reserve {size} bytes of shared memory in {directory}: {e}") from e
        finally:
            os.close(fd)
        mm[:_HEAD.size] = _HEAD.pack(_MAGIC, nonce, os.getpid())
        return cls(path, mm, nonce, owner=True)

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
        return cls(info.path, mm, nonce, owner=False)

    def info(self) -> ShmInfo:
        return ShmInfo(path=self.path, size=len(self._mm), offset=HEADER_BYTES, nonce=self._nonce.hex(),
                       hostname=socket.gethostname())

    def tensor(self, layout: PoolLayout) -> torch.Tensor:
        """The pool as `layout.shape`. The mapping lives as long as any tensor viewing it; it is never
        unmapped explicitly (an explicit munmap under a live view would crash the process)."""
        raw = torch.frombuffer(self._mm, dtype=torch.uint8, count=_pool_bytes(layout), offset=HEADER_BYTES)
        return raw.view(layout.torch_dtype).view(layout.shape)

    def unlink(self) -> None:
        if self._owner:
            self._owner = False
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass


def cleanup_stale_segments(directory: str = SHM_DIR) -> list[str]:
    """Remove segments whose owner process no longer exists; returns the paths removed."""
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
        try:
            os.kill(pid, 0)
            continue                      # alive (or not ours to judge)
        except ProcessLookupError:
            pass
        except PermissionError:
            continue
        path = os.path.join(directory, name)
        try:
            os.unlink(path)
            removed.append(path)
        except OSError:
            pass
    return removed


class ShmPath:
    """P side: copies page runs into the peer's mapped pool, then tells D with a WROTE note."""

    kind = "shm"

    def __init__(self, channel: Channel, src: torch.Tensor, segment: Segment, dst_layout: PoolLayout):
        self._ch = channel
        self._src = src
        self._segment = segment
        self._dst = segment.tensor(dst_layout)
        self._bytes_per_page = dst_layout.page_bytes * dst_layout.num_layers * 2

    def write(self, room: int, runs: np.ndarray, stop: Callable[[], bool]) -> int:
        """Copy runs `[n, 3]` (src_start, dst_start, length); stops between runs once `stop()` is true.
        Returns the bytes copied."""
        src, dst = self._src, self._dst
        started = time.monotonic()
        pages = 0
        for s, d, n in runs.tolist():
            if stop():
                break
            dst[:, :, d:d + n].copy_(src[:, :, s:s + n])
            pages += n
        nbytes = pages * self._bytes_per_page
        # Same host, so CLOCK_MONOTONIC is shared: D times the room from the copy's start.
        self._ch.send(Kind.WROTE, room, WROTE_BODY.pack(started), payload_len=nbytes)
        return nbytes

    def close(self) -> None:
        self._dst = None          # the mapping goes when the last view is freed
        self._segment = None
