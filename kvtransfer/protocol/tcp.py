"""tcp data path: page bytes travel on the control connection itself, so it works between any two hosts.

A WRITE frame's payload is the source pages of every layer (a WRITE_LAYERS frame's: of its layers),
in the order of the pool's `PoolLayout.geometry` (page-first: page by page; layer-first: region-major
and run-minor), sent with one gather `sendmsg` per IOV_MAX pieces
straight from P's pool and received with one scatter `recvmsg` per IOV_MAX pieces straight into D's
pool: no staging buffer, no copy besides the kernel's.
With crc32c checksums (protocol/checksum.py) both sides move ~1 MiB at a time instead and hash each
chunk right after the kernel copied it, while it is in cache.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from tandem.kvtransfer.base import PoolLayout
from tandem.kvtransfer.datapath import Incoming, Link, ReceiverPath, SenderPath, flip_byte
from tandem.kvtransfer.protocol import checksum
from tandem.kvtransfer.protocol.iovec import IOV_MAX, page_iov, recv_iov, send_iov, split_iov
from tandem.kvtransfer.protocol.wire import (
    HEADER,
    Channel,
    Kind,
    ProtocolError,
    ReceiverMetadata,
    layers_body,
)


class TcpReceiverPath(ReceiverPath):
    """D side: reads a WRITE frame's pages from the control connection straight into the pool."""

    kind = "tcp"
    layer_writes = True

    def __init__(self, layout: PoolLayout, host: str, worker_id: str, *, native_iov: bool = True):
        self._layout = layout
        self._native = native_iov
        self._pool: torch.Tensor | None = None

    def attach(self, pool: torch.Tensor, busy: Callable[[], bool]) -> None:
        self._pool = pool

    def incoming(self, ch: Channel, body: bytes, payload_len: int, layers: tuple[int, int] | None = None) -> Incoming:
        if len(body) % 16:
            raise ProtocolError("WRITE body is not int64 (dst_start, length) pairs")
        runs = np.frombuffer(body, dtype="<i8").reshape(-1, 2)
        return Incoming(runs, lambda stop: recv_pages(ch, self._pool, self._layout, runs, stop, self._native,
                                                      layers=layers)[0],
                        lambda: ch.drain(payload_len),
                        lambda stop, algorithm: recv_pages(ch, self._pool, self._layout, runs, stop, self._native,
                                                           algorithm, layers))


class TcpSenderPath(SenderPath):
    """P side: any receiver that offers tcp is reachable (the control connection carries the pages)."""

    kind = "tcp"

    def __init__(self, layout: PoolLayout, worker_id: str, *, native_iov: bool = True):
        self._layout = layout
        self._native = native_iov
        self._src: torch.Tensor | None = None

    def attach(self, pool: torch.Tensor) -> None:
        self._src = pool

    def link(self, peer_id: str, meta: ReceiverMetadata) -> TcpLink:
        return TcpLink(self._src, self._layout, self._native)


class TcpLink(Link):
    """P side: sends a room's page runs on the control channel (called from the peer's sender thread)."""

    kind = "tcp"
    layer_writes = True

    def __init__(self, src: torch.Tensor, layout: PoolLayout, native: bool = True):
        self._src = src
        self._layout = layout
        self._native = native

    def write(self, room: int, runs: np.ndarray, stop: Callable[[], bool], corrupt: bool = False,
              layers: tuple[int, int] | None = None) -> int:
        """Sends runs `[n, 3]` (src_start, dst_start, length) as one WRITE frame (WRITE_LAYERS with
        `layers`).

        A started frame is always sent whole (the receiver drains what it no longer wants), so `stop`
        is not consulted: the in-flight write of an aborted room takes at most one frame's time.
        """
        return self._send(room, runs, corrupt, "", layers)[0]

    def sums_inline(self) -> tuple[str, ...]:
        return ("crc32c",) if checksum.native_crc32c() else ()

    def write_summed(self, room: int, runs: np.ndarray, stop: Callable[[], bool], algorithm: str,
                     corrupt: bool = False, layers: tuple[int, int] | None = None) -> tuple[int, int]:
        """`write`, with the CRC-32C of the source bytes in wire order, each chunk hashed right after
        the socket took it (still in cache)."""
        return self._send(room, runs, corrupt, algorithm, layers)

    def _send(self, room: int, runs: np.ndarray, corrupt: bool, algorithm: str,
              layers: tuple[int, int] | None) -> tuple[int, int]:
        base = self._src.data_ptr()
        geometry = self._layout.geometry(layers)
        iov = page_iov(base, geometry, runs[:, 0], runs[:, 2])
        if algorithm == "crc32c":     # hashed a chunk at a time, right after it went out
            iov = split_iov(iov, checksum.SUMMED_CHUNK_BYTES)
        wire = iov
        if corrupt:       # the first piece goes out from a copy with a byte flipped (the checksum is P's)
            start, n = int(iov[0, 0]) - base, int(iov[0, 1])
            tampered = self._src.view(-1).view(torch.uint8).numpy()[start:start + n].copy()
            flip_byte(tampered)
            wire = iov.copy()
            wire[0] = (tampered.ctypes.data, n)
        body = np.ascontiguousarray(runs[:, 1:], dtype="<i8").tobytes()
        kind = Kind.WRITE if layers is None else Kind.WRITE_LAYERS
        if layers is not None:
            body = layers_body(layers) + body
        payload = int(runs[:, 2].sum()) * geometry.page_bytes
        crc = checksum.native_crc32c() if algorithm == "crc32c" else None
        value = 0
        ch = self.ch
        with ch.send_lock:
            if ch.closed:
                raise ConnectionError("channel closed")
            ch.sock.sendall(HEADER.pack(kind, len(body), room, payload) + body)
            if crc is None:
                send_iov(ch.sock, wire, self._native)
            else:
                for lo, hi in _chunks(iov):
                    send_iov(ch.sock, wire[lo:hi], self._native)
                    value = crc.iov(iov[lo:hi], value)
        return payload, value


def _chunks(iov: np.ndarray) -> list[tuple[int, int]]:
    """[lo, hi) slices of `iov` of about SUMMED_CHUNK_BYTES each (at least one entry, at most IOV_MAX)."""
    per = max(1, min(IOV_MAX, checksum.SUMMED_CHUNK_BYTES // max(1, int(iov[0, 1]) if len(iov) else 1)))
    return [(lo, min(lo + per, len(iov))) for lo in range(0, len(iov), per)]


def recv_pages(channel: Channel, buffer: torch.Tensor, layout: PoolLayout, runs: np.ndarray,
               stop: Callable[[], bool], native: bool = True, algorithm: str = "",
               layers: tuple[int, int] | None = None) -> tuple[int, int | None]:
    """D side: receive a WRITE payload for runs `[n, 2]` (dst_start, length) straight into `buffer`
    (a WRITE_LAYERS payload: `layers` (first, end) only).

    `stop` is checked before every chunk; once it is true the rest of the payload is drained and
    discarded. Returns the bytes that landed in the pool and, for `algorithm` "crc32c" (where the native
    one is here), the CRC-32C of what landed, each chunk hashed right after it arrived; else None.
    """
    assert runs.size == 0 or int((runs[:, 0] + runs[:, 1]).max()) <= layout.num_pages
    iov = page_iov(buffer.data_ptr(), layout.geometry(layers), runs[:, 0], runs[:, 1])
    crc = checksum.native_crc32c() if algorithm == "crc32c" else None
    if crc is not None:
        iov = split_iov(iov, checksum.SUMMED_CHUNK_BYTES)
    chunks = _chunks(iov) if crc is not None else [(lo, min(lo + IOV_MAX, len(iov))) for lo in range(0, len(iov), IOV_MAX)]
    total = int(iov[:, 1].sum())
    landed, value = 0, 0
    for lo, hi in chunks:
        if stop():
            channel.drain(total - landed)
            break
        chunk = iov[lo:hi]
        recv_iov(channel.sock, chunk, native)
        landed += int(chunk[:, 1].sum())
        if crc is not None:
            value = crc.iov(chunk, value)
    return landed, (value if crc is not None else None)
