"""tcp data path: page bytes travel on the control connection itself, so it works between any two hosts.

A WRITE frame's payload is the source pages of every (layer, K|V) region, region-major and run-minor,
sent with one gather `sendmsg` per IOV_MAX pages straight from P's pool and received with one scatter
`recvmsg` per IOV_MAX pages straight into D's pool: no staging buffer, no copy besides the kernel's.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from tandem.kvtransfer.base import PoolLayout
from tandem.kvtransfer.datapath import Incoming, Link, ReceiverPath, SenderPath, flip_byte
from tandem.kvtransfer.protocol.iovec import IOV_MAX, page_iov, recv_iov, send_iov
from tandem.kvtransfer.protocol.wire import HEADER, Channel, Kind, ProtocolError, ReceiverMetadata


def _regions(layout: PoolLayout) -> np.ndarray:
    return np.arange(layout.num_layers * 2, dtype=np.int64) * layout.num_pages


class TcpReceiverPath(ReceiverPath):
    """D side: reads a WRITE frame's pages from the control connection straight into the pool."""

    kind = "tcp"

    def __init__(self, layout: PoolLayout, host: str, worker_id: str, *, native_iov: bool = True):
        self._layout = layout
        self._native = native_iov
        self._pool: torch.Tensor | None = None

    def attach(self, pool: torch.Tensor, busy: Callable[[], bool]) -> None:
        self._pool = pool

    def incoming(self, ch: Channel, body: bytes, payload_len: int) -> Incoming:
        if len(body) % 16:
            raise ProtocolError("WRITE body is not int64 (dst_start, length) pairs")
        runs = np.frombuffer(body, dtype="<i8").reshape(-1, 2)
        return Incoming(runs, lambda stop: recv_pages(ch, self._pool, self._layout, runs, stop, self._native),
                        lambda: ch.drain(payload_len))


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

    def __init__(self, src: torch.Tensor, layout: PoolLayout, native: bool = True):
        self._src = src
        self._layout = layout
        self._regions = _regions(layout)
        self._native = native

    def write(self, room: int, runs: np.ndarray, stop: Callable[[], bool], corrupt: bool = False) -> int:
        """Sends runs `[n, 3]` (src_start, dst_start, length) as one WRITE frame.

        A started frame is always sent whole (the receiver drains what it no longer wants), so `stop`
        is not consulted: the in-flight write of an aborted room takes at most one frame's time.
        """
        pb = self._layout.page_bytes
        base = self._src.data_ptr()
        iov = page_iov(base, self._regions, runs[:, 0], runs[:, 2], pb)
        if corrupt:       # the first piece goes out from a copy with a byte flipped
            start, n = int(iov[0, 0]) - base, int(iov[0, 1])
            tampered = self._src.view(-1).view(torch.uint8).numpy()[start:start + n].copy()
            flip_byte(tampered)
            iov[0] = (tampered.ctypes.data, n)
        body = np.ascontiguousarray(runs[:, 1:], dtype="<i8").tobytes()
        payload = int(runs[:, 2].sum()) * len(self._regions) * pb
        ch = self.ch
        with ch.send_lock:
            if ch.closed:
                raise ConnectionError("channel closed")
            ch.sock.sendall(HEADER.pack(Kind.WRITE, len(body), room, payload) + body)
            send_iov(ch.sock, iov, self._native)
        return payload


def recv_pages(channel: Channel, buffer: torch.Tensor, layout: PoolLayout, runs: np.ndarray,
               stop: Callable[[], bool], native: bool = True) -> int:
    """D side: receive a WRITE payload for runs `[n, 2]` (dst_start, length) straight into `buffer`.

    `stop` is checked before every IOV_MAX pages; once it is true the rest of the payload is drained
    and discarded. Returns the bytes that landed in the pool.
    """
    assert runs.size == 0 or int((runs[:, 0] + runs[:, 1]).max()) <= layout.num_pages
    iov = page_iov(buffer.data_ptr(), _regions(layout), runs[:, 0], runs[:, 1], layout.page_bytes)
    total = int(iov[:, 1].sum())
    landed = 0
    for i in range(0, len(iov), IOV_MAX):
        if stop():
            channel.drain(total - landed)
            break
        chunk = iov[i:i + IOV_MAX]
        recv_iov(channel.sock, chunk, native)
        landed += int(chunk[:, 1].sum())
    return landed
