"""P side of the protocol, for every backend: one persistent control connection per peer.

Per peer, two threads: a sender thread that runs the peer's FIFO of jobs (writes through the peer's
data path `Link` — bytes on the socket for tcp, copies into D's mapped pool for shm, NIXL WRITEs, UCX
messages — then FINISH, ABORT, ABORT_ACK frames), and a reader thread for D's replies (DONE ->
SUCCESS, ABORT -> FAILED) that also notices a dead connection at once (EOF/reset; keepalive for a
silent host).

Progress: `progress()` only queues a PROGRESS frame at the head of the peer's queue (the engine step
never waits on the socket); a report not yet sent is updated in place, so a slow connection holds at
most one report per room.

Failure: when the connection fails every unfinished room of that peer becomes FAILED and its queue is
dropped; `connect()` again makes a fresh connection.

Checksums (protocol/checksum.py): to a receiver that checks them, a write is cut into pieces of at
most PIECE_BYTES; `write()` queues each piece's checksum on the checksum threads at once
(the source pages do not change until the room is released), and the sender thread follows each
piece with its SUMS frame. Fault injection (`corrupt`, test-only) flips one byte of a drawn room's
first piece on its way, after the checksum was taken.

Layer writes (`writes_layers`: the receiver takes them over this path): `write(..., layers=(first, end))`
sends those layers only (WRITE_LAYERS), so P can stream a room while its forward pass runs.

Abort: `abort(room)` fails the room, puts an ABORT frame at the head of the queue (so D fails the
room too), and waits until the sender thread is not working on the room (queued jobs of a failed room
are skipped; an shm copy stops at the next run, or piece where it checksums on the way; a tcp frame
already started is sent whole). After it returns P never reads the room's source pages again, so they
may be reused; bytes already handed to the socket reach D before the ABORT frame, and D's own state
decides what lands (see receiver.py).

Close (`RoomTable.close`, kvtransfer/base.py, once): every unfinished room fails, then `_shutdown`:
every peer's connection is dropped and its threads joined (each link is closed as its reader ends),
and last the data paths release what they hold.
"""

from __future__ import annotations

import collections
import logging
import socket
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass

import numpy as np
import torch

from tandem.kvtransfer.base import (
    KVSender,
    PoolLayout,
    Progress,
    Room,
    RoomState,
    RoomStatus,
    RoomTable,
    TransferError,
)
from tandem.kvtransfer.datapath import Link, SenderPath
from tandem.kvtransfer.protocol import checksum, handshake
from tandem.kvtransfer.protocol.runs import merge_runs, split_runs
from tandem.kvtransfer.protocol.wire import (
    MAX_BODY,
    Channel,
    Kind,
    ProtocolError,
    ReceiverMetadata,
    Timeouts,
    configure,
    progress_body,
    serve_until_lost,
)

log = logging.getLogger(__name__)


@dataclass
class _Job:
    kind: Kind
    room: int
    runs: np.ndarray | None = None           # WRITE: [n, 3] (src_start, dst_start, length)
    body: bytes = b""
    sums: Future | None = None               # WRITE: its checksum, for the SUMS frame after it
    layers: tuple[int, int] | None = None    # WRITE: of these layers (first, end) only (WRITE_LAYERS)
    corrupt: bool = False                    # WRITE: fault injection flips a byte of it in flight


class _Peer:
    def __init__(self, peer_id: str, meta_bytes: bytes, meta: ReceiverMetadata, channel: Channel, link: Link,
                 lock: threading.Lock):
        self.id = peer_id
        self.meta_bytes = meta_bytes
        self.meta = meta
        self.ch = channel
        self.link = link
        self.checksum = ""                       # the algorithm of the SUMS sent to it ("": none)
        self.inline = link.sums_inline()         # ... those its link computes on the way
        self.layer_writes = link.layer_writes and link.kind in meta.layer_writes   # WRITE_LAYERS reach it
        self.cond = threading.Condition(lock)
        self.queue: collections.deque[_Job] = collections.deque()
        self.reports: dict[int, _Job] = {}       # room -> its PROGRESS job still in `queue`
        self.busy_room: int | None = None
        self.alive = True
        self.error = ""
        self.reader: threading.Thread | None = None
        self.writer: threading.Thread | None = None


@dataclass(eq=False, kw_only=True)
class _Room(Room):
    peer_id: str | None                      # None: aborted before any write named a peer
    state: RoomState = RoomState.TRANSFERRING
    finished: bool = False                   # finish() was called
    tamper: bool | None = None               # fault injection's draw for the room (None: not drawn yet)


class Sender(RoomTable, KVSender):
    side = "sender"

    def __init__(self, buffer: torch.Tensor, layout: PoolLayout, worker_id: str, *, name: str,
                 paths: Sequence[SenderPath], timeouts: Timeouts = Timeouts(), secret: bytes | None = None,
                 boot_epoch: int = 0, checksums: Sequence[str] | None = None,
                 corrupt: Callable[[int], bool] | None = None):
        """`paths`: the data paths to try for each peer, in order (registry.py makes them); from here on
        the sender owns them. `secret`: the key this sender proves in each handshake and requires
        receivers to prove (None: no proof); `boot_epoch`: this process start, which receivers bind
        rooms to (0: not told). `checksums`: the algorithms this sender may use for the SUMS it sends
        to receivers that check them (None: every one this process has; (): none, only to measure
        what they cost). `corrupt`: fault injection for tests (services/worker/fault_sender.py),
        never set from a request: a room for which it returns True has one byte of its first write
        flipped on the way, after its checksum was taken."""
        if tuple(buffer.shape) != layout.shape or buffer.dtype != layout.torch_dtype:
            raise ValueError(f"buffer {tuple(buffer.shape)} {buffer.dtype} does not match {layout}")
        if buffer.device.type != "cpu" or not buffer.is_contiguous():
            raise ValueError("the socket-based backends need a contiguous CPU pool")
        RoomTable.__init__(self)
        self.name = name
        self.layout = layout
        self.worker_id = worker_id
        self._buffer = buffer
        self._paths = tuple(paths)
        self._sums: checksum.ChecksumPool | None = None
        try:
            for p in self._paths:
                p.attach(buffer)
        except BaseException:
            self._close_paths()
            raise
        self._timeouts = timeouts
        self._key = secret
        self.boot_epoch = boot_epoch
        self._connect_lock = threading.Lock()
        self._peers: dict[str, _Peer] = {}
        self._algorithms = checksum.available() if checksums is None else tuple(checksums)
        if self._algorithms:
            self._sums = checksum.ChecksumPool(buffer, layout, f"kv-sums-{worker_id}")
        self._piece_pages = checksum.piece_pages(layout)
        self._corrupt = corrupt

    # ---- KVSender -------------------------------------------------------------------------------------

    def connect(self, peer_id: str, metadata: bytes) -> None:
        """Idempotent for the same metadata; new metadata for a known peer replaces its connection
        (failing the old connection's unfinished rooms)."""
        meta = ReceiverMetadata.from_bytes(metadata)
        if meta.worker_id != peer_id:
            raise TransferError(f"metadata is for worker {meta.worker_id!r}, not {peer_id!r}")
        if not self.layout.compatible(meta.layout):
            raise TransferError(f"incompatible pool layouts: sender {self.layout}, receiver {meta.layout}")
        with self._connect_lock:
            with self._lock:
                self._check_open()
                old = self._peers.get(peer_id)
                if old is not None and old.alive and old.meta_bytes == metadata:
                    return
            if old is not None:
                self._peer_lost(old, "replaced by a new connection")
            peer, aborted = self._open(peer_id, metadata, meta)
            with self._lock:
                closed = self._closed
                if not closed:
                    self._peers[peer_id] = peer
                    for room in aborted:
                        self._fail(self._rooms.setdefault(room, _Room(peer_id=peer_id)), "aborted by receiver")
            if closed:
                peer.ch.close()
                peer.link.close()
                raise TransferError("sender is closed")
            peer.writer = threading.Thread(target=self._write_loop, args=(peer,), daemon=True,
                                           name=f"kv-tx-{self.worker_id}->{peer_id}")
            peer.reader = threading.Thread(target=self._read_loop, args=(peer,), daemon=True,
                                           name=f"kv-txr-{self.worker_id}<-{peer_id}")
            peer.writer.start()
            peer.reader.start()

    def has_peer(self, peer_id: str) -> bool:
        with self._lock:
            peer = self._peers.get(peer_id)
            return peer is not None and peer.alive

    def path_kind(self, peer_id: str) -> str:
        """The data path chosen for a connected peer ("tcp", "shm", "nixl", "ucx")."""
        with self._lock:
            return self._peers[peer_id].link.kind

    def transports(self, peer_id: str) -> list:
        with self._lock:
            peer = self._peers.get(peer_id)
        return peer.link.transports() if peer is not None else []

    def writes_layers(self, peer_id: str) -> bool:
        with self._lock:
            peer = self._peers.get(peer_id)
            return peer is not None and peer.alive and peer.layer_writes

    def write(self, peer_id: str, room: int, src_pages: list[int], dst_pages: list[int],
              layers: tuple[int, int] | None = None) -> None:
        if len(src_pages) != len(dst_pages):
            raise ValueError(f"{len(src_pages)} source pages but {len(dst_pages)} destination pages")
        peer = self._peer(peer_id)
        if layers is not None and not 0 <= layers[0] < layers[1] <= self.layout.num_layers:
            raise ValueError(f"room {room}: layers {layers} of a {self.layout.num_layers}-layer pool")
        if layers is not None and not peer.layer_writes:
            raise TransferError(f"{peer_id} takes no layer writes over {peer.link.kind}")
        src = np.asarray(src_pages, dtype=np.int64).reshape(-1)
        dst = np.asarray(dst_pages, dtype=np.int64).reshape(-1)
        if src.size and (src.min() < 0 or src.max() >= self.layout.num_pages):
            raise ValueError(f"room {room}: source pages outside [0, {self.layout.num_pages})")
        if dst.size and (dst.min() < 0 or dst.max() >= peer.meta.layout.num_pages):
            raise ValueError(f"room {room}: destination pages outside [0, {peer.meta.layout.num_pages})")
        runs = np.asarray(merge_runs(src.tolist(), dst.tolist()), dtype=np.int64).reshape(-1, 3)
        per = checksum.piece_pages(self.layout, self.layout.span(layers)) if layers else self._piece_pages
        pieces = split_runs(runs, per) if peer.checksum else [runs]
        self._enqueue(peer_id, room, *(_Job(Kind.WRITE, room, runs=piece, layers=layers)
                                       for piece in pieces if len(piece)))

    def finish(self, peer_id: str, room: int, aux: bytes) -> None:
        if len(aux) > MAX_BODY:
            raise ValueError(f"aux record of {len(aux)} bytes")
        self._enqueue(peer_id, room, _Job(Kind.FINISH, room, body=bytes(aux)), finish=True)

    def progress(self, peer_id: str, room: int, progress: Progress) -> None:
        body = progress_body(progress)
        with self._lock:
            peer = self._peers.get(peer_id)
            r = self._rooms.get(room)
            if self._closed or peer is None or not peer.alive or not peer.meta.progress:
                return
            if r is not None and (r.state.done or r.peer_id not in (None, peer_id)):
                return
            job = peer.reports.get(room)
            if job is not None:
                job.body = body
                return
            # Ahead of queued writes: a report says P is computing, and must not wait behind a backlog.
            peer.reports[room] = job = _Job(Kind.PROGRESS, room, body=body)
            peer.queue.appendleft(job)
            peer.cond.notify_all()

    def status(self, room: int) -> RoomStatus:
        with self._lock:
            return self._status(room)

    def abort(self, room: int) -> None:
        with self._lock:
            r = self._rooms.get(room)
            if r is None:
                self._rooms[room] = _Room(peer_id=None, state=RoomState.FAILED, error="aborted by sender")
                return
            if r.state.done:
                return
            self._fail(r, "aborted by sender")
            peer = self._peers.get(r.peer_id) if r.peer_id is not None else None
            if peer is None or not peer.alive:
                return
            peer.queue.appendleft(_Job(Kind.ABORT, room, body=b"aborted by sender"))
            peer.cond.notify_all()
            if self._wait_idle(peer, room, self._timeouts.abort):
                return
        log.warning("abort of room %d: write to %s still in flight after %.1fs, dropping the connection",
                    room, peer.id, self._timeouts.abort)
        self._peer_lost(peer, f"abort of room {room} timed out")
        with self._lock:
            self._wait_idle(peer, room, self._timeouts.abort)

    # ---- teardown (RoomTable.close calls it once, after failing every room) -------------------------

    def _shutdown(self) -> None:
        with self._lock:
            peers = list(self._peers.values())   # no new one: connect() sees _closed
        for peer in peers:
            self._peer_lost(peer, "sender closed")
        for peer in peers:
            if peer.reader is not None:
                peer.reader.join(self._timeouts.connect)
        self._close_paths()

    def _close_paths(self) -> None:
        for p in self._paths:
            p.close()
        if self._sums is not None:
            self._sums.close()

    # ---- helpers --------------------------------------------------------------------------------------

    def _peer(self, peer_id: str) -> _Peer:
        with self._lock:
            self._check_open()
            peer = self._peers.get(peer_id)
        if peer is None:
            raise TransferError(f"unknown peer {peer_id!r}: connect() it first")
        return peer

    def _enqueue(self, peer_id: str, room: int, *jobs: _Job, finish: bool = False) -> None:
        self._peer(peer_id)
        with self._lock:
            peer = self._peers[peer_id]
            r = self._rooms.get(room)
            if r is None:
                r = self._rooms[room] = _Room(peer_id=peer_id)
            elif r.peer_id is None:
                r.peer_id = peer_id
            elif r.peer_id != peer_id:
                raise ValueError(f"room {room} goes to {r.peer_id!r}, not {peer_id!r}")
            if r.finished:
                raise ValueError(f"room {room} is already finished")
            r.finished = finish
            if r.state.done:
                return                                  # failed or aborted: drop quietly, status tells
            if not peer.alive:
                self._fail(r, f"peer {peer_id} lost: {peer.error}")
                return
            if r.t_first is None:
                r.t_first = time.monotonic()
            if jobs and jobs[0].kind == Kind.WRITE and r.tamper is None and self._corrupt is not None:
                r.tamper = jobs[0].corrupt = bool(self._corrupt(room))
            for job in jobs:        # over (src_start, length): P's own pages, unless the link hashes them
                if job.kind == Kind.WRITE and peer.checksum and peer.checksum not in peer.inline:
                    job.sums = self._sums.submit(job.runs[:, ::2], peer.checksum, job.layers)
            if jobs:
                peer.queue.extend(jobs)
                peer.cond.notify_all()

    def _wait_idle(self, peer: _Peer, room: int, timeout: float) -> bool:
        """Caller holds the lock. True once the sender thread is not working on `room`."""
        deadline = time.monotonic() + timeout
        while peer.busy_room == room:
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            peer.cond.wait(left)
        return True

    def _open(self, peer_id: str, metadata: bytes, meta: ReceiverMetadata) -> tuple[_Peer, list[int]]:
        """Pick the first data path that can reach the peer, connect, and say hello; raises TransferError."""
        reasons, link = [], None
        for path in self._paths:
            if path.kind not in meta.backends:
                reasons.append(f"{path.kind}: not offered by the receiver")
                continue
            try:
                link = path.link(peer_id, meta)
                break
            except TransferError as e:
                reasons.append(f"{path.kind}: {e}")
        if link is None:
            raise TransferError(f"no usable transfer path to {peer_id}: {'; '.join(reasons)}")
        try:
            sock = socket.create_connection((meta.host, meta.port), timeout=self._timeouts.connect)
        except OSError as e:
            link.close()
            raise TransferError(f"cannot connect to {peer_id} at {meta.host}:{meta.port}: {e}") from e
        ch = Channel(sock)
        try:
            configure(sock, self._timeouts)
            algorithm = checksum.choose(meta.checksums, self._algorithms)
            aborted = handshake.open_connection(
                ch, key=self._key, sender_id=self.worker_id, epoch=self.boot_epoch, receiver_id=meta.worker_id,
                path=link.kind, layout=self.layout, timeouts=self._timeouts, checksum=algorithm)
            link.start(ch)
        except BaseException as e:
            ch.close()
            link.close()
            if isinstance(e, OSError):
                raise TransferError(f"handshake with {peer_id} failed: {e}") from e
            raise
        log.info("KV link to %s at %s:%d over %s%s", peer_id, meta.host, meta.port, link.kind,
                 f" (skipped {'; '.join(reasons)})" if reasons else "")
        if self._algorithms and not algorithm:
            log.warning("KV receiver %s checks none of the checksums %s (it predates them): transfers to it "
                        "are not verified", peer_id, list(self._algorithms))
        peer = _Peer(peer_id, metadata, meta, ch, link, self._lock)
        peer.checksum = algorithm
        return peer, aborted

    def _write_loop(self, peer: _Peer) -> None:
        while True:
            with self._lock:
                while peer.alive and not peer.queue:
                    peer.cond.wait()
                if not peer.alive:
                    return
                job = peer.queue.popleft()
                r = self._rooms.get(job.room)
                if job.kind == Kind.PROGRESS:
                    del peer.reports[job.room]
                    if r is not None and r.state.done:
                        continue
                elif job.kind in (Kind.WRITE, Kind.FINISH):
                    if r is None or r.state.done or r.peer_id != peer.id:
                        if job.sums is not None:
                            job.sums.cancel()
                        continue                        # the room failed or was aborted: skip
                    peer.busy_room = job.room
            nbytes = 0
            try:
                ranged = {"layers": job.layers} if job.layers is not None else {}
                if job.kind == Kind.WRITE and peer.checksum in peer.inline:
                    nbytes, value = peer.link.write_summed(job.room, job.runs, lambda r=r: r.state.done,
                                                           peer.checksum, corrupt=job.corrupt, **ranged)
                    self._send_sums(peer, job, r, nbytes, value)
                elif job.kind == Kind.WRITE:
                    nbytes = peer.link.write(job.room, job.runs, lambda r=r: r.state.done, corrupt=job.corrupt,
                                             **ranged)
                    if job.sums is not None:
                        self._send_sums(peer, job, r, nbytes, None)
                else:
                    peer.ch.send(job.kind, job.room, job.body)
            except Exception as e:
                if not isinstance(e, OSError | TransferError):
                    log.exception("kv sender to %s crashed", peer.id)
                self._peer_lost(peer, f"send failed: {e!r}")
            with self._lock:
                peer.busy_room = None
                if r is not None:
                    r.bytes += nbytes
                peer.cond.notify_all()
                if not peer.alive:
                    return

    def _send_sums(self, peer: _Peer, job: _Job, r: _Room, nbytes: int, value: int | None) -> None:
        """The SUMS frame of a write the link moved whole (one it cut short belongs to a failed room):
        `value`, the link's own checksum of it, or the checksum threads'."""
        whole = int(job.runs[:, 2].sum()) * self.layout.span(job.layers) * 2 * self.layout.page_bytes
        if nbytes != whole or r.state.done:
            if job.sums is not None:
                job.sums.cancel()
            return
        value = job.sums.result() if value is None else value
        peer.ch.send(Kind.SUMS, job.room, checksum.sums_body(job.runs[:, 1:], value))

    def _read_loop(self, peer: _Peer) -> None:
        def frames() -> None:
            while True:
                kind, room, body, _ = peer.ch.recv_frame()
                with self._lock:
                    r = self._rooms.get(room)
                    mine = r is not None and r.peer_id == peer.id
                    if kind == Kind.DONE:
                        if mine and not r.state.done:
                            r.state, r.t_done = RoomState.SUCCESS, time.monotonic()
                            self._cond.notify_all()
                    elif kind == Kind.ABORT:
                        if mine:
                            self._fail(r, f"aborted by receiver: {body.decode(errors='replace')}")
                        # Acknowledge once the sender thread is past any work on the room (FIFO).
                        peer.queue.appendleft(_Job(Kind.ABORT_ACK, room))
                        peer.cond.notify_all()
                    else:
                        raise ProtocolError(f"unexpected {kind.name} frame from the receiver")

        def lost(reason: str) -> None:
            self._peer_lost(peer, reason)
            if peer.writer is not None:
                peer.writer.join()
            peer.ch.close()
            peer.link.close()

        serve_until_lost(frames, lost, f"kv sender reader for {peer.id}")

    def _peer_lost(self, peer: _Peer, reason: str) -> None:
        with self._lock:
            if not peer.alive:
                return
            peer.alive = False
            peer.error = reason
            for job in peer.queue:
                if job.sums is not None:
                    job.sums.cancel()
            peer.queue.clear()
            peer.reports.clear()
            if self._peers.get(peer.id) is peer:
                for r in self._rooms.values():
                    if r.peer_id == peer.id:
                        self._fail(r, f"peer {peer.id} lost: {reason}")
            peer.cond.notify_all()
        peer.ch.shutdown()
