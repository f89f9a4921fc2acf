"""D side of the protocol, for every backend: owns D's pool, the room table and the control connections.

Threads: one accept thread, plus one reader thread per sender connection that handles its frames in
order (a WRITE's bytes go straight into the pool through the connection's data path). Public methods
only take the room-table lock and send small frames.

Data paths (kvtransfer/datapath.py): the receiver accepts those it was given, advertises their
entries in its metadata, hands WRITE frames to the connection's path, and checks and accounts WROTE
notes of one-sided paths itself. Integrity: from a sender that announced checksums, every landed
write is checked (room_checks.py). Progress: a PROGRESS frame from the room's own sender is its
latest report (`poll` returns it, stamped with its arrival on this side's clock); D's worker decides
what it means for the room's deadline.

Failure: a connection that ends (EOF, reset, keepalive) fails its unfinished rooms (and, if it was its
sender's current one, that sender's rooms not yet bound to any).

Abort: `abort(room)` fails the room, then (two-sided paths: tcp, ucx) waits until the reader is not
receiving into its pages (later writes are drained and discarded) or (one-sided: shm, nixl) sends
ABORT and waits for P's ABORT_ACK, sent once P's sender thread is past any copy for it. A room of a
sender not connected yet is listed in the hello acknowledgement, so P learns before it can write. An
abort not settled within `Timeouts.abort` drops the connection (failing that sender's other rooms).

Close (`RoomTable.close`, once): unfinished rooms fail; `_shutdown` makes the paths unreachable, shuts
the listener and connections down (threads joined), then the paths release what they hold.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import socket
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from tandem.kvtransfer.base import (
    KVReceiver,
    PoolLayout,
    Progress,
    Room,
    RoomState,
    RoomStatus,
    RoomTable,
    TransferError,
)
from tandem.kvtransfer.datapath import ReceiverPath
from tandem.kvtransfer.protocol import checksum, handshake
from tandem.kvtransfer.protocol.room_checks import RoomChecks
from tandem.kvtransfer.protocol.runs import pages_error
from tandem.kvtransfer.protocol.wire import (
    HEADER,
    WROTE_BODY,
    Channel,
    Kind,
    ProtocolError,
    ReceiverMetadata,
    Timeouts,
    configure,
    parse_progress,
    serve_until_lost,
    split_layers,
)

log = logging.getLogger(__name__)

_MAX_TOMBSTONES = 65536


class _Conn:
    def __init__(self, channel: Channel, addr: object):
        self.ch = channel
        self.addr = addr
        self.peer_id: str | None = None      # proven by the handshake when the receiver has a key
        self.epoch = 0                       # the sender's boot epoch (0: it did not say)
        self.path = ""                       # data path the sender announced (a key of Receiver._paths)
        self.checksum = ""                   # checksum of the SUMS frames the sender announced ("": none)
        self.alive = True
        self.busy_room: int | None = None    # room whose WRITE payload is being received into the pool
        self.awaiting: set[int] = set()      # rooms of a one-sided path whose abort() waits for P's ack
        self.acked: set[int] = set()
        self.thread: threading.Thread | None = None


@dataclass(eq=False, kw_only=True)
class _Room(Room):
    peer_id: str
    pages: np.ndarray                        # sorted destination pages
    peer_epoch: int = 0                      # the sender instance paired with the room (0: any)
    state: RoomState = RoomState.WAITING_FOR_INPUT
    aux: bytes | None = None
    conn: _Conn | None = None                # the connection that first wrote to it
    progress: Progress | None = None         # the sender's latest PROGRESS report
    # Integrity (checked only for a sender that announced checksums), counted in (page, layer) units:
    landed_pages: int = 0                    # page-layers of writes that landed whole
    summed_pages: int = 0                    # ... of them, named by the SUMS frame that followed
    last_runs: np.ndarray | None = None      # (dst_start, length) of the last write, until its SUMS came
    last_layers: tuple[int, int] | None = None   # ... its layers (first, end); None: all
    last_sum: int | None = None              # ... its checksum, where the data path computed it on arrival
    checking: int = 0                        # checks still running on the checksum threads
    mismatch: str = ""                       # why a check failed (the room fails at FINISH)
    finish: bytes | None = None              # the aux record of a FINISH that waits for the checks
    corrupt: bool = False
    landed_at: float = 0.0                   # when the last piece's SUMS came (its bytes had landed)

    def status(self) -> RoomStatus:
        return dataclasses.replace(super().status(), aux=self.aux, progress=self.progress, corrupt=self.corrupt,
                                   path=self.conn.path if self.conn is not None else "", landed_at=self.landed_at)


class Receiver(RoomChecks, RoomTable, KVReceiver):
    side = "receiver"

    def __init__(self, layout: PoolLayout, host: str, worker_id: str, *, name: str,
                 paths: Sequence[ReceiverPath], timeouts: Timeouts = Timeouts(), secret: bytes | None = None):
        """`paths`: the data paths senders may use, in order of preference (registry.py makes them);
        from here on the receiver owns them. `secret`: the key senders must prove in the handshake
        (None: anyone may connect)."""
        self.name = name
        self._key = secret
        self.refusals = handshake.RefusalLog()
        self.layout = layout
        self.worker_id = worker_id
        self._paths = {p.kind: p for p in paths}
        self._backends = tuple(self._paths)
        self._timeouts = timeouts
        RoomTable.__init__(self)
        self._conns: set[_Conn] = set()
        self._peer_conn: dict[str, _Conn] = {}
        self._tombstones: collections.OrderedDict[tuple[str, int], None] = collections.OrderedDict()
        self.progress_reports = 0            # PROGRESS frames kept (an extra of this implementation)
        self.integrity_by_path: collections.Counter[str] = collections.Counter()   # rooms failed by their checksums
        self._sums: checksum.ChecksumPool | None = None
        try:
            self._buffer = next((m for p in self._paths.values() if (m := p.memory()) is not None), None)
            if self._buffer is None:
                self._buffer = torch.zeros(layout.shape, dtype=layout.torch_dtype)
            entries = {}
            for p in self._paths.values():
                entry = p.attach(self._buffer, lambda: bool(self._rooms))
                if entry is not None:
                    entries[p.kind] = entry
            try:
                self._listener = socket.create_server((host, 0))
            except OSError as e:
                raise TransferError(f"cannot listen on {host!r}: {e}") from e
        except BaseException:
            self._close_paths()
            raise
        self._sums = checksum.ChecksumPool(self._buffer, layout, f"kv-check-{worker_id}")
        port = self._listener.getsockname()[1]
        advertised = host if host not in ("", "0.0.0.0", "::") else socket.gethostname()
        self._meta = ReceiverMetadata(worker_id=worker_id, layout=layout, host=advertised, port=port,
                                      backends=self._backends, progress=True, checksums=checksum.available(),
                                      layer_writes=tuple(k for k, p in self._paths.items() if p.layer_writes),
                                      entries=entries)
        self._accept_thread = threading.Thread(target=self._accept_loop, name=f"kv-accept-{worker_id}", daemon=True)
        self._accept_thread.start()

    # ---- KVReceiver -------------------------------------------------------------------------------

    @property
    def buffer(self) -> torch.Tensor:
        return self._buffer

    def metadata(self) -> bytes:
        return self._meta.to_bytes()

    def expect(self, room: int, dst_pages: list[int], peer_id: str, peer_epoch: int = 0) -> None:
        pages = np.asarray(dst_pages, dtype=np.int64).reshape(-1)
        if pages.size and (pages.min() < 0 or pages.max() >= self.layout.num_pages):
            raise ValueError(f"room {room}: destination pages outside [0, {self.layout.num_pages})")
        pages = np.unique(pages)
        if pages.size != len(dst_pages):
            raise ValueError(f"room {room}: duplicate destination pages")
        with self._lock:
            self._check_open()
            if room in self._rooms:
                raise ValueError(f"room {room} is already expected")
            self._rooms[room] = _Room(peer_id=peer_id, pages=pages, peer_epoch=peer_epoch)

    def poll(self, room: int) -> RoomStatus:
        with self._lock:
            return self._status(room)

    def abort(self, room: int) -> None:
        with self._lock:
            r = self._rooms.get(room)
            if r is None or r.state.done:
                return
            self._fail(r, "aborted by receiver")
            conn = r.conn or self._peer_conn.get(r.peer_id)
            if conn is None or not conn.alive:
                self._tombstone(r.peer_id, room)
                return
            wait_ack = self._paths[conn.path].one_sided
            if wait_ack:
                conn.awaiting.add(room)
        conn.ch.try_send(Kind.ABORT, room, b"aborted by receiver")
        deadline = time.monotonic() + self._timeouts.abort
        with self._lock:
            def pending() -> bool:
                return conn.busy_room == room or (wait_ack and room not in conn.acked)

            while conn.alive and pending() and (left := deadline - time.monotonic()) > 0:
                self._cond.wait(left)
            stuck = conn.alive and pending()
            conn.awaiting.discard(room)
            conn.acked.discard(room)
        if stuck:
            log.warning("abort of room %d not acknowledged by %s within %.1fs: dropping the connection",
                        room, conn.peer_id, self._timeouts.abort)
            conn.ch.shutdown()
            if conn.thread is not None and conn.thread is not threading.current_thread():
                conn.thread.join(self._timeouts.abort)

    # ---- teardown (RoomTable.close calls it once, after failing every room) -------------------------

    def _shutdown(self) -> None:
        with self._lock:
            conns = list(self._conns)        # no new one: the accept loop sees _closed
        for p in self._paths.values():
            p.shutdown()                     # first: the joins below may wait; shm's file must not
        try:
            self._listener.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        for c in conns:
            c.ch.shutdown()
        self._accept_thread.join(self._timeouts.connect)
        for c in conns:
            if c.thread is not None:
                c.thread.join(self._timeouts.connect)
        self._listener.close()
        self._close_paths()

    def _close_paths(self) -> None:
        for p in self._paths.values():
            p.shutdown()
            p.close()
        if self._sums is not None:
            self._sums.close()

    # ---- helpers ------------------------------------------------------------------------------------

    def _tombstone(self, peer_id: str, room: int) -> None:
        self._tombstones[(peer_id, room)] = None
        while len(self._tombstones) > _MAX_TOMBSTONES:
            self._tombstones.popitem(last=False)

    def _accept_loop(self) -> None:
        while True:
            try:
                sock, addr = self._listener.accept()
            except OSError:
                return                           # listener shut down by close()
            conn = _Conn(Channel(sock), addr)
            with self._lock:
                if self._closed:
                    sock.close()
                    return
                self._conns.add(conn)
            conn.thread = threading.Thread(target=self._serve, args=(conn,), daemon=True,
                                           name=f"kv-rx-{self.worker_id}-{addr}")
            conn.thread.start()

    def _serve(self, conn: _Conn) -> None:
        def frames() -> None:
            configure(conn.ch.sock, self._timeouts)
            self._handshake(conn)
            while True:
                kind, body_len, room, payload_len = conn.ch.recv_header()
                body = conn.ch.recv_exact(body_len) if body_len else b""
                if kind in (Kind.WRITE, Kind.WRITE_LAYERS):
                    self._on_write(conn, room, body, payload_len, kind == Kind.WRITE_LAYERS)
                elif kind in (Kind.WROTE, Kind.WROTE_LAYERS):
                    self._on_wrote(conn, room, *self._layers(conn, body, kind == Kind.WROTE_LAYERS), payload_len)
                elif kind == Kind.FINISH:
                    self._on_finish(conn, room, body)
                elif kind == Kind.PROGRESS:
                    self._on_progress(conn, room, body)
                elif kind == Kind.SUMS:
                    self._on_sums(conn, room, body)
                elif kind == Kind.ABORT:
                    self._on_peer_abort(conn, room, body)
                elif kind == Kind.ABORT_ACK:
                    with self._lock:
                        if room in conn.awaiting:
                            conn.acked.add(room)
                            self._cond.notify_all()
                else:
                    raise ProtocolError(f"unexpected {kind.name} frame")

        def lost(reason: str) -> None:
            self._conn_lost(conn, reason)
            conn.ch.close()

        serve_until_lost(frames, lost, f"kv receiver connection from {conn.peer_id or conn.addr}")

    def _handshake(self, conn: _Conn) -> None:
        conn.ch.sock.settimeout(self._timeouts.connect)
        challenge = handshake.send_challenge(conn.ch)
        kind, _, body, _ = conn.ch.recv_frame()
        if kind != Kind.HELLO:
            raise ProtocolError(f"expected HELLO, got {kind.name}")
        hello, error = handshake.check_hello(body, key=self._key, challenge=challenge, receiver_id=self.worker_id,
                                             layout=self.layout, backends=self._backends,
                                             checksums=checksum.available())
        aborted: list[int] = []
        # Registration and the ack are one step on this connection's send lock: an abort() that finds
        # the connection sends its ABORT only after the ack; one that ran before left a tombstone.
        with conn.ch.send_lock:
            with self._lock:
                if not error and self._closed:
                    error = "receiver closed"
                who = f"{hello.peer_id!r} at {conn.addr}" if hello is not None else conn.addr
                if error:   # counted before the sender can learn of it
                    self.refusals.refused(f"kv receiver {self.worker_id}", f"sender {who}", error)
                else:
                    conn.peer_id, conn.epoch, conn.path = hello.peer_id, hello.epoch, hello.path
                    conn.checksum = hello.checksum
                    self._peer_conn[hello.peer_id] = conn
                    aborted = [room for (p, room) in self._tombstones if p == hello.peer_id]
                    for room in aborted:
                        del self._tombstones[(hello.peer_id, room)]
            ack = handshake.ack_body(key=self._key, challenge=challenge, receiver_id=self.worker_id, hello=hello,
                                     error=error, aborted=aborted)
            conn.ch.sock.sendall(HEADER.pack(Kind.HELLO_ACK, len(ack), 0, 0) + ack)
        if error:
            raise TransferError(f"rejected sender {who}: {error}")
        if not conn.checksum:
            log.warning("kv receiver %s: sender %s sends no KV checksums (it predates them or has them off): "
                        "its transfers are not verified", self.worker_id, who)
        conn.ch.sock.settimeout(None)

    def _owner_error(self, conn: _Conn, r: _Room | None) -> str:
        """Why `conn` may not touch room `r` ("" if it may). Caller holds the lock."""
        if r is None:
            return "unknown room (aborted, released or never expected)"
        if r.peer_id != conn.peer_id:
            return f"room is paired with sender {r.peer_id!r}, not {conn.peer_id!r}"
        if r.peer_epoch and conn.epoch != r.peer_epoch:
            return f"room is paired with instance {r.peer_epoch:x} of {r.peer_id}, not instance {conn.epoch:x}"
        return ""

    def _refuse(self, conn: _Conn, room: int, why: str) -> None:
        """Log a frame refused for its room (a lost race after an abort is normal and only debug-logged).
        Caller holds the lock: the refusal is counted before the room's state or the sender shows it."""
        if why.startswith("unknown room") or why.startswith("room already"):
            log.debug("kv receiver %s: frame of room %d from %s dropped: %s", self.worker_id, room, conn.peer_id, why)
        else:
            self.refusals.refused(f"kv receiver {self.worker_id}", f"a write of room {room} from {conn.peer_id}", why)

    def _check_write(self, conn: _Conn, r: _Room | None, runs: np.ndarray, payload_len: int, layers: int) -> str:
        """Why a WRITE must be discarded ("" if it may land). Caller holds the lock."""
        why = self._owner_error(conn, r)
        if why:
            return why
        if r.state.done:
            return f"room already {r.state.value}"
        if runs.size == 0:
            return "empty run"
        why = pages_error(r.pages, runs)
        if why:
            return why
        total = int(runs[:, 1].sum())
        if payload_len != total * layers * 2 * self.layout.page_bytes:
            return f"payload of {payload_len} bytes for {total} pages of {layers} layers"
        return ""

    def _admit_write(self, conn: _Conn, room: int, runs: np.ndarray, payload_len: int,
                     layers: int) -> tuple[_Room | None, str]:
        """Whether a WRITE may land: (room, "") with the room TRANSFERRING and `conn` busy on it, or
        (room, why not), logged. A refused write fails the room only when it came from the room's own
        sender: a stranger's write never hurts someone else's room."""
        with self._lock:
            r = self._rooms.get(room)
            why = self._check_write(conn, r, runs, payload_len, layers)
            if why:
                self._refuse(conn, room, why)
                if not self._owner_error(conn, r) and not r.state.done:
                    self._fail(r, f"bad write: {why}")
            else:
                conn.busy_room = room
                r.conn = conn
                r.state = RoomState.TRANSFERRING
                if r.t_first is None:
                    r.t_first = time.monotonic()
        return r, why

    def _layers(self, conn: _Conn, body: bytes, ranged: bool) -> tuple[bytes, tuple[int, int] | None]:
        """A write's body and its layers ((first, end) of a layer write, else None)."""
        if ranged and not self._paths[conn.path].layer_writes:
            raise ProtocolError(f"a layer write over {conn.path}, which takes none")
        return (body, None) if not ranged else split_layers(body, self.layout.num_layers)[::-1]

    def _on_write(self, conn: _Conn, room: int, body: bytes, payload_len: int, ranged: bool) -> None:
        """A two-sided path's write (`ranged`: of a few layers only): its path reads the bytes; this side
        decides whether they may land."""
        path = self._paths[conn.path]
        body, layers = self._layers(conn, body, ranged)
        incoming = path.incoming(conn.ch, body, payload_len, layers) if ranged else path.incoming(conn.ch, body, payload_len)
        r, why = self._admit_write(conn, room, incoming.runs, payload_len, self.layout.span(layers))
        if why:
            incoming.discard()
            conn.ch.try_send(Kind.ABORT, room, why.encode())
            return
        landed, value = 0, None
        try:
            landed, value = self._receive(conn, incoming, lambda: r.state.done)
        finally:
            with self._lock:
                conn.busy_room = None
                r.bytes += landed
                self._landed(r, incoming.runs, landed, value, layers)
                self._cond.notify_all()

    def _on_wrote(self, conn: _Conn, room: int, body: bytes, layers: tuple[int, int] | None, payload_len: int) -> None:
        """A one-sided path copied pages (of `layers`, if set) itself: account for them, if the room's."""
        if len(body) < WROTE_BODY.size or (len(body) - WROTE_BODY.size) % 16:
            raise ProtocolError("bad WROTE body")
        now = time.monotonic()
        started = WROTE_BODY.unpack_from(body)[0]       # the copy's start, on this host's clock
        if not 0.0 <= now - started < 600.0:              # another clock after all (time namespace)
            started = now
        runs = np.frombuffer(body, dtype="<i8", offset=WROTE_BODY.size).reshape(-1, 2)
        with self._lock:
            r = self._rooms.get(room)
            why = self._owner_error(conn, r) or ("" if not r.state.done else f"room already {r.state.value}")
            outside = "" if why else pages_error(r.pages, runs)
            why = why or outside
            if why:
                self._refuse(conn, room, why)
                if outside:     # the bytes are in our memory already: the room fails
                    self._fail(r, f"bad write: {why}")
            else:
                r.conn = conn
                r.state = RoomState.TRANSFERRING
                r.bytes += payload_len
                r.t_first = started if r.t_first is None else min(r.t_first, started)
                self._landed(r, runs, payload_len, layers=layers)
        if why:
            conn.ch.try_send(Kind.ABORT, room, why.encode())

    def _on_finish(self, conn: _Conn, room: int, aux: bytes) -> None:
        reply = None
        with self._lock:
            r = self._rooms.get(room)
            why = self._owner_error(conn, r) or ("" if not r.state.done else f"room already {r.state.value}: {r.error}")
            if not why and r.finish is not None:
                why = "room already finished"
            if not why:
                r.conn, r.finish = conn, aux
                if not r.checking:           # else the last check settles the room
                    reply = self._settle(conn, room, r)
            else:
                self._refuse(conn, room, why)
        if why:
            conn.ch.try_send(Kind.ABORT, room, why.encode())
        elif reply is not None:
            conn.ch.try_send(reply[0], room, reply[1])

    def _on_progress(self, conn: _Conn, room: int, body: bytes) -> None:
        """Keep the report of a room this sender owns and that still waits; anything else is a report
        that crossed an abort or a release on the wire, and is dropped without an answer."""
        progress = parse_progress(body, time.monotonic())
        with self._lock:
            r = self._rooms.get(room)
            if not self._owner_error(conn, r) and not r.state.done:
                r.progress = progress
                self.progress_reports += 1

    def _on_peer_abort(self, conn: _Conn, room: int, reason: bytes) -> None:
        with self._lock:
            r = self._rooms.get(room)
            if not self._owner_error(conn, r):
                self._fail(r, f"aborted by sender: {reason.decode(errors='replace')}")

    def _conn_lost(self, conn: _Conn, reason: str) -> None:
        with self._lock:
            conn.alive = False
            self._conns.discard(conn)
            current = conn.peer_id is not None and self._peer_conn.get(conn.peer_id) is conn
            if current:
                del self._peer_conn[conn.peer_id]
            if conn.peer_id is not None:
                for r in self._rooms.values():
                    if self._owner_error(conn, r):
                        continue                 # another sender's, or another instance's of it
                    if r.conn is conn or (r.conn is None and current):
                        self._fail(r, f"connection from {conn.peer_id} lost: {reason}")
            self._cond.notify_all()
        if conn.path:
            self._paths[conn.path].conn_lost(conn.ch)

