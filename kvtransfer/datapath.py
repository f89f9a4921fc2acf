"""The plug-in interface between the transfer protocol (kvtransfer/protocol/) and a data path.

The protocol owns everything except moving the page bytes: one control connection per (sender,
receiver) pair (hello, FINISH/DONE, ABORT/ABORT_ACK, PROGRESS), both sides' room tables, timeouts,
peer death and teardown. A data path moves the page runs of a room's writes from P's pool into D's
pool and tells D, on that control connection, what it moved. The protocol carries two data paths
itself (protocol/shm.py, protocol/tcp.py); kvtransfer/backends/ plugs in the others (nixl, ucx). A new
one (Mooncake, say) is one module with a `ReceiverPath`, a `SenderPath` and a `Link`, named in
registry.py.

Two kinds of data path:
- two-sided (tcp, ucx): D takes part. P sends a WRITE frame whose body is the path's own (the
  destination runs, and whatever else the path needs), then the bytes: on the control connection
  (tcp) or on the path's own connection (ucx). D's `ReceiverPath.incoming` reads them into the pool.
- one-sided (shm, nixl): P puts the bytes into D's memory itself, then sends a WROTE note
  (`wire.wrote_body`), which D checks against the room's pages and accounts. D's abort therefore
  waits for P's ABORT_ACK before the room's pages may be reused.

Lifecycle. A path object is made by the registry with its options only (`layout, host, worker_id` on D,
`layout, worker_id` on P, then keyword options its constructor names); it takes no resource until the
protocol's receiver or sender calls it:
- D: `memory` → `attach` (once) → `incoming` / `conn_lost` from connection threads → `shutdown` →
  `close` once no connection uses the path any more.
- P: `attach(pool)` → per peer `link`, `Link.start` after the handshake, `Link.write` from that peer's
  sender thread, `Link.close` when the connection ends → `close`.
Methods without @abstractmethod are optional hooks: the default does nothing (or has nothing to say).
Every `close` (and `shutdown`) may be called twice, and on an object whose `attach` / `start` failed or
never ran: the protocol calls them on every path, whatever happened before.
"""

from __future__ import annotations

import random
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch

from tandem.kvtransfer.protocol.wire import Channel, ProtocolError, ReceiverMetadata


@dataclass(frozen=True)
class Incoming:
    """One WRITE frame's bytes on a two-sided path, not read yet. The protocol calls exactly one of
    `receive` (the write may land) and `discard` (it was refused), from the connection's thread."""

    runs: np.ndarray                                  # [n, 2] (dst_start, length), checked by the protocol
    receive: Callable[[Callable[[], bool]], int]      # (stop) -> bytes that landed in the pool; once
                                                      # stop() is true the rest is read and dropped
    discard: Callable[[], None]                       # read all of it, land none
    # `receive` that also computes a checksum (protocol/checksum.py) of the bytes as they land, while
    # they are in cache: (stop, algorithm) -> (bytes landed, checksum, or None where the path does not
    # compute that algorithm). None: the path computes none (the receiver's checksum threads read them).
    receive_summed: Callable[[Callable[[], bool], str], tuple[int, int | None]] | None = None


class ReceiverPath(ABC):
    """D side of a data path: what lets senders write D's pool this way."""

    kind: ClassVar[str]          # its name in the metadata's `backends`, in a sender's hello, in registry.py
    one_sided: ClassVar[bool] = False
    layer_writes: ClassVar[bool] = False   # `incoming` takes WRITE_LAYERS frames (`layers` set)

    def memory(self) -> torch.Tensor | None:
        """D's pool (`layout.shape`, zero-filled) if this path must provide it (shm: in a shared-memory
        file); None: the receiver allocates it. The first path that provides one wins."""
        return None

    def attach(self, pool: torch.Tensor, busy: Callable[[], bool]) -> dict | None:
        """Make `pool` reachable this way (register it, listen); returns this path's entry in the
        receiver metadata (under `kind`), or None. `busy()` is true while the receiver expects rooms.
        Raises TransferError."""
        return None

    def incoming(self, ch: Channel, body: bytes, payload_len: int, layers: tuple[int, int] | None = None) -> Incoming:
        """Two-sided paths: a WRITE frame arrived on control channel `ch` (one per connection); with
        `layers` (first, end), a WRITE_LAYERS frame of those layers only (paths with `layer_writes`).
        Raises ProtocolError for a body it cannot parse (the connection is dropped)."""
        raise ProtocolError(f"the {self.kind} data path sends no WRITE frames")

    def conn_lost(self, ch: Channel) -> None:  # noqa: B027
        """Control channel `ch` ended: drop what the path kept for it."""

    def shutdown(self) -> None:  # noqa: B027
        """First step of the receiver's close: no new sender can reach the pool this way (shm: the
        file goes, so a close that then hangs cannot leave it behind)."""

    def close(self) -> None:  # noqa: B027
        """Last step of the receiver's close, once its connections are down: release the rest."""


class Link(ABC):
    """P side: a data path to one peer, used from that peer's sender thread only."""

    kind: ClassVar[str]
    ch: Channel | None = None
    # `write` and `write_summed` also take `layers=(first, end)`: the runs' pages of those layers only
    # (a WRITE_LAYERS frame), for streaming a room while its prefill runs.
    layer_writes: ClassVar[bool] = False

    def start(self, ch: Channel) -> None:
        """After the handshake: `ch` is the control channel to report on (WRITE frames, WROTE notes);
        a path with a connection of its own opens it here. Raises TransferError."""
        self.ch = ch

    @abstractmethod
    def write(self, room: int, runs: np.ndarray, stop: Callable[[], bool], corrupt: bool = False) -> int:
        """Move runs `[n, 3]` (src_start, dst_start, length) of every (layer, K|V), and tell D on the
        channel. May stop between pieces once `stop()` is true (the room failed). Returns the bytes
        moved. Raises OSError or TransferError when the peer cannot be reached (the connection fails).

        `corrupt` (fault injection, tests only): one byte of what lands in D's pool differs from P's pool
        (`flip_byte` on the bytes in flight, or on D's memory after the copy); P's pool is never touched."""

    def sums_inline(self) -> tuple[str, ...]:
        """The checksums `write_summed` computes while it moves the bytes (protocol/checksum.py); for
        others the sender's checksum threads read the source pages once more."""
        return ()

    def write_summed(self, room: int, runs: np.ndarray, stop: Callable[[], bool], algorithm: str,
                     corrupt: bool = False) -> tuple[int, int]:
        """`write`, computing checksum `algorithm` (one of `sums_inline`) of the source bytes on the way:
        (bytes moved, checksum). `corrupt` spoils what lands, never the checksum."""
        raise NotImplementedError(f"the {self.kind} data path computes no checksum itself")

    def transports(self) -> list:
        """The transports (kvtransfer.backends.ucx_transports.Transport) this link uses, where the
        library says; [] = not known."""
        return []

    def close(self) -> None:  # noqa: B027
        """Release what `SenderPath.link` and `start` took."""


class SenderPath(ABC):
    """P side of a data path: the sender's resources for it (an agent, a UCX worker) and its links."""

    kind: ClassVar[str]

    def attach(self, pool: torch.Tensor) -> None:  # noqa: B027
        """P's pool (`layout.shape`, contiguous, CPU), once, before any link. Raises TransferError."""

    @abstractmethod
    def link(self, peer_id: str, meta: ReceiverMetadata) -> Link:
        """Before the control connection opens: a link to this receiver (`meta.entries` holds the
        entries receivers' paths advertised), or TransferError saying why this path cannot reach it
        (a sender with several paths then tries the next)."""

    def close(self) -> None:  # noqa: B027
        """After every link is closed (or abandoned): release what `attach` took."""


def flip_byte(buf: np.ndarray) -> None:
    """Fault injection (`Link.write(corrupt=True)`): XOR one byte of `buf` (uint8, in place) at a random
    place with a random non-zero mask."""
    buf[random.randrange(len(buf))] ^= random.randrange(1, 256)
