"""The transfer engine's interface (what the services use), and the types every side shares.

Every backend (registry.py) is the same protocol (kvtransfer/protocol/: control connection, rooms,
aborts, teardown) over its own data paths (kvtransfer/datapath.py: shm and tcp in protocol/, nixl and
ucx in backends/).

Direction: the prefill worker P *writes* a room's KV pages into pages the decode worker D reserved.
D owns a `KVReceiver`: it allocates (and exposes) D's whole KV pool memory and learns when a room is
complete. P owns a `KVSender`: it writes page runs of its own pool into D's pool and finally sends
the room's aux record, which completes the room on D.

Pool layout (both sides the same, see engine/kvcache/kv_pool.py): one tensor, page-first
`[num_pages, num_layers, 2, page_size, kv_heads, head_dim]` (a page of every layer is one piece, a run
of consecutive pages one byte range) or layer-first `[num_layers, 2, num_pages, ...]` (a run is one
byte range per (layer, K|V)). A transfer copies whole pages of every layer (or of a group of layers),
K and V; consecutive page ids on both sides are merged into runs. `PoolLayout.geometry` says where a
write's bytes lie; every data path and checksum walks them in its order.

Room states (both sides): Bootstrapping -> WaitingForInput -> Transferring -> Success | Failed.
Integrity: a room succeeds only if D's pages match what P read from its pool (protocol/checksum.py;
a mismatch fails it with `RoomStatus.corrupt`), unless the peer predates checksums.
Thread-safety: every method may be called from any thread; writes for one peer are applied in the
order they were issued.
"""

from __future__ import annotations

import enum
import threading
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

import torch


class RoomState(enum.Enum):
    BOOTSTRAPPING = "bootstrapping"
    WAITING_FOR_INPUT = "waiting_for_input"
    TRANSFERRING = "transferring"
    SUCCESS = "success"
    FAILED = "failed"

    @property
    def done(self) -> bool:
        return self in (RoomState.SUCCESS, RoomState.FAILED)


class TransferError(Exception):
    """A transfer could not be set up or failed (bad metadata, peer gone, layout mismatch)."""


@dataclass(frozen=True)
class Geometry:
    """Where the bytes of a write (of some layers) lie in a pool: `regions` regions `region_stride`
    bytes apart, starting `offset` bytes into the pool; in each, page p's `piece` bytes start at
    `p * page_stride`. Where `piece == page_stride` a run of pages is one byte range per region.

    The order every data path moves them in and every checksum reads them in: region-major, then
    run, then page (`page_iov`)."""

    offset: int
    regions: int
    region_stride: int
    piece: int
    page_stride: int

    @property
    def runs_contiguous(self) -> bool:
        return self.piece == self.page_stride

    @property
    def page_bytes(self) -> int:
        """Bytes of one page in a write of this geometry."""
        return self.regions * self.piece


@dataclass(frozen=True)
class PoolLayout:
    num_layers: int
    num_pages: int
    page_size: int
    kv_heads: int
    head_dim: int
    dtype: str                       # "bfloat16" | "float16" | "float32"
    kv_layout: str = "page_first"    # "page_first" | "layer_first" (engine/kvcache/kv_pool.py)

    @classmethod
    def from_dict(cls, d: dict) -> PoolLayout:
        """A peer's layout as sent in its metadata; a peer that names no layout predates page-first pools."""
        return cls(**{"kv_layout": "layer_first", **d})

    @property
    def page_first(self) -> bool:
        return self.kv_layout == "page_first"

    @property
    def shape(self) -> tuple[int, ...]:
        page = (self.page_size, self.kv_heads, self.head_dim)
        if self.page_first:
            return (self.num_pages, self.num_layers, 2, *page)
        return (self.num_layers, 2, self.num_pages, *page)

    def by_page(self, pool: torch.Tensor) -> torch.Tensor:
        """`pool` (shape `self.shape`) viewed as `[num_pages, num_layers, 2, page_size, kv_heads, head_dim]`."""
        return pool if self.page_first else pool.movedim(2, 0)

    def geometry(self, layers: tuple[int, int] | None = None) -> Geometry:
        """Where a write of `layers` (first, end; None: every layer) lies in this pool."""
        first, end = layers or (0, self.num_layers)
        pb = self.page_bytes
        if self.page_first:
            return Geometry(2 * first * pb, 1, 0, 2 * (end - first) * pb, 2 * self.num_layers * pb)
        return Geometry(2 * first * self.num_pages * pb, 2 * (end - first), self.num_pages * pb, pb, pb)

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    @property
    def page_bytes(self) -> int:
        """Bytes of one page of one layer's K (or V)."""
        return self.page_size * self.kv_heads * self.head_dim * torch.empty((), dtype=self.torch_dtype).element_size()

    def span(self, layers: tuple[int, int] | None) -> int:
        """Layers in a write of `layers` (first, end); None: every layer."""
        return layers[1] - layers[0] if layers else self.num_layers

    def compatible(self, other: PoolLayout) -> bool:
        """Same page geometry and layout (the page counts of the two pools may differ)."""
        return (self.num_layers, self.page_size, self.kv_heads, self.head_dim, self.dtype, self.kv_layout) == (
            other.num_layers, other.page_size, other.kv_heads, other.head_dim, other.dtype, other.kv_layout)


@dataclass(frozen=True)
class Progress:
    """A prefill worker's report on a room it is still computing (the PROGRESS frame, wire.py)."""

    tokens_done: int                 # prompt tokens whose KV P has computed (prefix-cache hits included)
    tokens_total: int                # tokens of the prompt
    queued_ahead: int                # prompt tokens P will compute before this room's next chunk
    expected_s: float                # P's estimate of the seconds until its next report for this room
    at: float = 0.0                  # D side: when it arrived (D's time.monotonic())


@dataclass
class RoomStatus:
    state: RoomState
    aux: bytes | None = None         # D side: the aux record, once SUCCESS
    error: str = ""
    bytes_moved: int = 0
    seconds: float = 0.0             # first write -> aux received (D) / completed (P)
    progress: Progress | None = None  # D side: the sender's latest report (None: none arrived)
    corrupt: bool = False            # D side: FAILED because its KV did not match the sender's checksums
    path: str = ""                   # D side: the data path its KV came over ("" before any write)
    landed_at: float = 0.0           # D side: when the last checked piece of its KV landed (D's monotonic; 0: none)


class KVReceiver(ABC):
    """D side. Allocates D's KV pool memory (`buffer`, zero-filled) so that writers can reach it."""

    name: str = ""

    @property
    @abstractmethod
    def buffer(self) -> torch.Tensor:
        """The pool tensor, shape `layout.shape`. D's KVPool adopts it as its storage."""

    @abstractmethod
    def metadata(self) -> bytes:
        """What a sender needs to reach this receiver (sent to P once per peer in the handshake)."""

    @abstractmethod
    def expect(self, room: int, dst_pages: list[int], peer_id: str, peer_epoch: int = 0) -> None:
        """Announce a room whose KV sender `peer_id` will write into `dst_pages` (-> WAITING_FOR_INPUT).

        Only that sender (and, when `peer_epoch` is not 0, only that process start of it, as its
        handshake says) may write the room, and only into `dst_pages`; anything else is refused.

        If the connection from that sender breaks, its unfinished rooms become FAILED.
        """

    @abstractmethod
    def poll(self, room: int) -> RoomStatus:
        """Current status of a room that `expect` announced."""

    @abstractmethod
    def abort(self, room: int) -> None:
        """Fail the room; after this returns no further write of this room lands in its pages."""

    @abstractmethod
    def release(self, room: int) -> None:
        """Forget a finished (success or failed) room."""

    @abstractmethod
    def close(self) -> None:
        """Release sockets and shared memory. Safe to call twice."""


class KVSender(ABC):
    """P side. Writes pages of P's pool (`buffer`) into a peer's pool."""

    name: str = ""

    @abstractmethod
    def connect(self, peer_id: str, metadata: bytes) -> None:
        """Register a peer from its receiver metadata (idempotent). Raises TransferError."""

    @abstractmethod
    def has_peer(self, peer_id: str) -> bool: ...

    def transports(self, peer_id: str) -> list:
        """The transports (kvtransfer.backends.ucx_transports.Transport) the data path to a connected peer
        uses, where the backend can ask its library (ucx); [] = not known."""
        return []

    @abstractmethod
    def write(self, peer_id: str, room: int, src_pages: list[int], dst_pages: list[int],
              layers: tuple[int, int] | None = None) -> None:
        """Queue a write of P's `src_pages` into the peer's `dst_pages` (same length), all layers (or
        `layers` (first, end), where `writes_layers`), K and V.

        Returns at once; the copy happens in the background. The room becomes TRANSFERRING.
        """

    def writes_layers(self, peer_id: str) -> bool:
        """Whether `write(..., layers=(first, end))` reaches this connected peer: only those layers of
        the pages, so a room can be sent a few layers at a time while its prefill runs."""
        return False

    @abstractmethod
    def finish(self, peer_id: str, room: int, aux: bytes) -> None:
        """Queue the room's aux record after its writes; when it lands the room is SUCCESS on both sides."""

    @abstractmethod
    def progress(self, peer_id: str, room: int, progress: Progress) -> None:
        """Tell the peer how far the room's prefill is (`progress.at` is not sent). Returns at once and
        never raises: the report travels ahead of queued writes, replaces an unsent one of the same
        room, and is dropped when the peer does not take reports or its connection is gone (the rooms
        on a lost connection fail anyway)."""

    @abstractmethod
    def status(self, room: int) -> RoomStatus: ...

    @abstractmethod
    def abort(self, room: int) -> None:
        """Fail the room; returns once no write of this room can still land on the peer."""

    @abstractmethod
    def release(self, room: int) -> None:
        """Forget a finished room."""

    @abstractmethod
    def close(self) -> None:
        """Safe to call twice."""


# ---- what the protocol's receiver and sender share (kvtransfer/protocol/) -------------------------------

@dataclass(eq=False, kw_only=True)
class Room:
    """One room's bookkeeping, on either side."""

    state: RoomState
    error: str = ""
    bytes: int = 0
    t_first: float | None = None     # first write (D: first byte; P: first write queued)
    t_done: float | None = None      # SUCCESS or FAILED

    def fail(self, why: str) -> bool:
        """FAILED with `why`, unless the room is done already; True if it changed."""
        if self.state.done:
            return False
        self.state, self.error, self.t_done = RoomState.FAILED, why, time.monotonic()
        return True

    def status(self) -> RoomStatus:
        end = self.t_done if self.state.done else time.monotonic()
        seconds = max(0.0, end - self.t_first) if self.t_first is not None and end is not None else 0.0
        return RoomStatus(state=self.state, error=self.error, bytes_moved=self.bytes, seconds=seconds)


class RoomTable(ABC):
    """The room table of a receiver or a sender, and the one lifecycle both follow.

    create (the side's __init__) -> serve -> `release` each finished room -> `close`: stop taking work,
    fail every unfinished room, then `_shutdown` (the side's connections and threads first, its data
    paths last). `close` is safe to call twice, from any thread: only the first call tears down.
    Subclasses keep their rooms (a `Room` each) in `_rooms` under `_lock`; `_cond` is notified when a
    room finishes."""

    side: ClassVar[str] = ""         # "receiver" | "sender", for errors and reasons

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._rooms: dict[int, Room] = {}
        self._closed = False

    @abstractmethod
    def abort(self, room: int) -> None: ...

    @abstractmethod
    def _shutdown(self) -> None:
        """The side's own teardown, after `close` failed its rooms. Runs once."""

    def release(self, room: int) -> None:
        """Forget a room; one not finished yet is aborted first."""
        with self._lock:
            r = self._rooms.get(room)
            if r is None:
                return
            done = r.state.done
        if not done:
            self.abort(room)
        with self._lock:
            self._rooms.pop(room, None)

    def close(self) -> None:
        """Stop taking work, fail every unfinished room, release connections, threads and data paths.
        Safe to call twice; a second call returns at once."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for r in self._rooms.values():
                r.fail(f"{self.side} closed")
            self._cond.notify_all()
        self._shutdown()

    def wait(self, room: int, timeout: float | None = None) -> RoomStatus:
        """Block until the room is SUCCESS or FAILED (or `timeout` passes); returns its status.
        An extra of the protocol's sides, not part of KVReceiver / KVSender."""
        with self._lock:
            self._cond.wait_for(lambda: self._status(room).state.done, timeout)
            return self._status(room)

    def _status(self, room: int) -> RoomStatus:
        """Caller holds the lock."""
        r = self._rooms.get(room)
        if r is None:
            raise KeyError(f"unknown room {room}")
        return r.status()

    def _fail(self, r: Room, why: str) -> None:
        """Caller holds the lock."""
        if r.fail(why):
            self._cond.notify_all()

    def _check_open(self) -> None:
        """Caller holds the lock."""
        if self._closed:
            raise TransferError(f"{self.side} is closed")
