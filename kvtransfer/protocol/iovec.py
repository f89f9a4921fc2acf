"""Scatter/gather socket IO straight from/into pool memory: no staging copy, no Python object per page.

An iovec list is a numpy `uint64 [n, 2]` array of (address, length). On Linux the kernel gets it as is
through libc `sendmsg`/`recvmsg` (ctypes releases the GIL for the call), up to IOV_MAX entries per
call; `recvmsg` uses MSG_WAITALL so one call fills up to IOV_MAX pages. Elsewhere the same loop runs
over Python's `socket.sendmsg`/`recvmsg_into` with one memoryview per entry.

The caller guarantees every address range lies in memory that stays alive for the call (pool
tensors, with page indices validated against the pool size before the iovecs are built).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
import socket
import sys
from collections.abc import Callable

import numpy as np

from tandem.kvtransfer.base import Geometry

IOV_MAX = 1024


class _MsgHdr(ctypes.Structure):  # struct msghdr, Linux layout
    _fields_ = [
        ("msg_name", ctypes.c_void_p), ("msg_namelen", ctypes.c_uint32),
        ("msg_iov", ctypes.c_void_p), ("msg_iovlen", ctypes.c_size_t),
        ("msg_control", ctypes.c_void_p), ("msg_controllen", ctypes.c_size_t),
        ("msg_flags", ctypes.c_int),
    ]


_libc: ctypes.CDLL | None = None


def _load_libc() -> ctypes.CDLL | None:
    global _libc
    if _libc is None and sys.platform == "linux":
        lib = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        for fn in (lib.sendmsg, lib.recvmsg):
            fn.argtypes = [ctypes.c_int, ctypes.POINTER(_MsgHdr), ctypes.c_int]
            fn.restype = ctypes.c_ssize_t
        _libc = lib
    return _libc


def page_iov(base: int, geometry: Geometry, starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Iovecs for runs of pages (`starts`, `lengths`) of a write of `geometry` in a pool at `base`:
    region-major, then run, then page (a run is one entry per region where its pages are contiguous)."""
    g = geometry
    starts, lengths = np.asarray(starts, dtype=np.int64), np.asarray(lengths, dtype=np.int64)
    if not g.runs_contiguous:
        starts, lengths = expand_runs(starts, lengths), None
    iov = np.empty((g.regions, len(starts), 2), dtype=np.uint64)
    iov[:, :, 0] = (base + g.offset + np.arange(g.regions, dtype=np.int64)[:, None] * g.region_stride
                    + starts[None, :] * g.page_stride)
    iov[:, :, 1] = g.piece if lengths is None else (lengths * g.piece)[None, :]
    return iov.reshape(-1, 2)


def expand_runs(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Every page of runs (`starts`, `lengths`), in order."""
    lengths = np.asarray(lengths, dtype=np.int64)
    first = np.cumsum(lengths) - lengths
    return np.repeat(np.asarray(starts, dtype=np.int64) - first, lengths) + np.arange(int(lengths.sum()))


def split_iov(iov: np.ndarray, max_bytes: int) -> np.ndarray:
    """`iov` with every entry longer than `max_bytes` cut into consecutive entries of at most that."""
    iov = np.asarray(iov, dtype=np.uint64).reshape(-1, 2)
    parts = np.maximum(1, -(-iov[:, 1].astype(np.int64) // max_bytes))
    if (parts == 1).all():
        return iov
    rows = np.repeat(np.arange(len(iov)), parts)
    k = np.arange(len(rows)) - np.repeat(np.cumsum(parts) - parts, parts)     # part index in its entry
    addr, length = iov[rows, 0].astype(np.int64), iov[rows, 1].astype(np.int64)
    out = np.empty((len(rows), 2), dtype=np.uint64)
    out[:, 0] = addr + k * max_bytes
    out[:, 1] = np.minimum(max_bytes, length - k * max_bytes)
    return out


def send_iov(sock: socket.socket, iov: np.ndarray, native: bool = True) -> None:
    """Send every byte the iovecs describe, in order. Raises OSError/TimeoutError on failure."""
    lib = _load_libc() if native else None
    if lib is not None:
        fd = sock.fileno()
        call = _native_call(lambda hdr: lib.sendmsg(fd, hdr, socket.MSG_NOSIGNAL))
    else:
        def call(chunk: np.ndarray) -> int:
            return sock.sendmsg(_views(chunk))
    _transfer(iov, call)


def recv_iov(sock: socket.socket, iov: np.ndarray, native: bool = True) -> None:
    """Fill every byte the iovecs describe, in order. Raises ConnectionError on EOF."""
    lib = _load_libc() if native else None
    if lib is not None:
        fd = sock.fileno()
        call = _native_call(lambda hdr: lib.recvmsg(fd, hdr, socket.MSG_WAITALL))
    else:
        def call(chunk: np.ndarray) -> int:
            return sock.recvmsg_into(_views(chunk), 0, socket.MSG_WAITALL)[0]
    _transfer(iov, call)


def _native_call(fn: Callable[[ctypes._Pointer], int]) -> Callable[[np.ndarray], int]:
    hdr = _MsgHdr()

    def call(chunk: np.ndarray) -> int:
        hdr.msg_iov = chunk.ctypes.data
        hdr.msg_iovlen = len(chunk)
        while True:
            n = fn(ctypes.byref(hdr))
            if n >= 0:
                return n
            err = ctypes.get_errno()
            if err == errno.EINTR:
                continue
            if err in (errno.EAGAIN, errno.EWOULDBLOCK):
                raise TimeoutError("socket send/recv timed out")
            raise OSError(err, os.strerror(err))

    return call


def _views(chunk: np.ndarray) -> list[memoryview]:
    return [memoryview((ctypes.c_char * int(n)).from_address(int(p))).cast("B") for p, n in chunk.tolist()]


def _transfer(iov: np.ndarray, call: Callable[[np.ndarray], int]) -> None:
    iov = np.asarray(iov, dtype=np.uint64).reshape(-1, 2)
    iov = iov[iov[:, 1] > 0]          # a copy (boolean indexing): partial transfers edit it
    i, n = 0, len(iov)
    while i < n:
        chunk = iov[i:min(n, i + IOV_MAX)]
        want = int(chunk[:, 1].sum())
        done = call(chunk)
        if done == want:
            i += len(chunk)
            continue
        if done == 0:
            raise ConnectionError("peer closed the connection")
        # Partial: skip the entries fully done, trim the one cut in the middle.
        ends = np.cumsum(chunk[:, 1])
        k = int(np.searchsorted(ends, done, side="right"))
        cut = done - (int(ends[k - 1]) if k else 0)
        iov[i + k, 0] += np.uint64(cut)
        iov[i + k, 1] -= np.uint64(cut)
        i += k
