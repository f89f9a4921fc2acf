"""The receiver's integrity checks, a part of `Receiver` (receiver.py) kept apart; everything here runs
under the receiver's lock unless it says otherwise, on the receiver's room and connection types.

From a sender that announced checksums (checksum.py), each write of a room is
followed by a SUMS frame naming exactly the runs that write delivered, and their checksum; the reader
hands the check to the checksum threads and reads on, so one piece is checked while the next lands. FINISH makes the
room SUCCESS only once every check of it has finished, every page that landed was checked, and all
matched; otherwise the room FAILS with "KV integrity check failed" (`RoomStatus.corrupt`), and P is
told with an ABORT. Failing it only at FINISH, when P has sent its last write of the room, keeps the
rule that no write lands in pages that may be reused. A sender from before checksums gets its rooms
completed unchecked (a warning per connection).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import CancelledError, Future
from typing import TYPE_CHECKING

import numpy as np

from tandem.kvtransfer.base import RoomState
from tandem.kvtransfer.protocol import checksum
from tandem.kvtransfer.protocol.wire import Kind, ProtocolError

if TYPE_CHECKING:
    from tandem.kvtransfer.datapath import Incoming
    from tandem.kvtransfer.protocol.receiver import _Conn, _Room

log = logging.getLogger("tandem.kvtransfer.protocol.receiver")


class RoomChecks:
    """Mixed into `Receiver`, whose lock, rooms, checksum pool (`_sums`) and failure path it uses."""

    @property
    def integrity_failures(self) -> int:
        """Rooms failed by their checksums so far (`integrity_by_path`: per data path), whether or not
        anyone polled them before they were aborted or released."""
        return sum(self.integrity_by_path.values())

    def _receive(self, conn: _Conn, incoming: Incoming, stop: Callable[[], bool]) -> tuple[int, int | None]:
        """A two-sided write's bytes into the pool: (bytes landed, their checksum where the data path
        computes it as they land, else None)."""
        if conn.checksum and incoming.receive_summed is not None:
            return incoming.receive_summed(stop, conn.checksum)
        return incoming.receive(stop), None

    def _landed(self, r: _Room, runs: np.ndarray, nbytes: int, value: int | None = None,
                layers: tuple[int, int] | None = None) -> None:
        """A write of runs `[n, 2]` (dst_start, length), of `layers` (first, end; None: all), put `nbytes`
        into the room's pages: a whole one waits for its SUMS. `value`: the checksum the data path
        computed of it as it landed (None: the checksum threads compute it). Caller holds the lock."""
        units = int(runs[:, 1].sum()) * self.layout.span(layers)
        if nbytes == units * 2 * self.layout.page_bytes:
            r.landed_pages += units
            r.last_runs, r.last_sum, r.last_layers = runs, value, layers

    def _on_sums(self, conn: _Conn, room: int, body: bytes) -> None:
        """The checksums of the write before: hand their check to the checksum threads and read on."""
        runs, sent = checksum.parse_sums(body)
        if not conn.checksum:
            raise ProtocolError("SUMS frame from a sender that announced no checksums")
        with self._lock:
            r = self._rooms.get(room)
            if self._owner_error(conn, r) or r.state.done or r.finish is not None:
                return                       # crossed an abort or a release on the wire
            expected, r.last_runs, value, r.last_sum = r.last_runs, None, r.last_sum, None
            if expected is None or not np.array_equal(expected, runs):
                r.mismatch = r.mismatch or "checksums for other pages than the write before them"
                return
            layers = r.last_layers
            r.summed_pages += int(runs[:, 1].sum()) * self.layout.span(layers)
            r.landed_at = time.monotonic()   # bytes are arriving: a slow link is not a dead one
            r.checking += 1
        if value is None:
            check = self._sums.submit(runs, conn.checksum, layers)
        else:                                # computed as the bytes landed
            check = Future()
            check.set_result(value)
        check.add_done_callback(lambda f: self._checked(conn, room, r, runs, sent, f))

    def _checked(self, conn: _Conn, room: int, r: _Room, runs: np.ndarray, sent: int, done: Future) -> None:
        """A check finished (on a checksum thread): note a mismatch; the room's last check after its
        FINISH settles it."""
        try:
            got = done.result()
        except CancelledError:
            got = None                       # the receiver is closing (its rooms fail)
        reply = None
        with self._lock:
            r.checking -= 1
            if got is not None and got != sent and not r.mismatch:
                pages = int(runs[:, 1].sum())
                r.mismatch = (f"the {pages} pages of a write (from page {int(runs[0, 0])}) differ from what the "
                              f"sender read ({conn.checksum} {got:x} here, {sent:x} sent)")
            if not r.checking and r.finish is not None and not r.state.done:
                reply = self._settle(conn, room, r)
        if reply is not None:
            conn.ch.try_send(reply[0], room, reply[1])

    def _settle(self, conn: _Conn, room: int, r: _Room) -> tuple[Kind, bytes]:
        """FINISH arrived and every check of the room is done: SUCCESS, or FAILED if its KV is not what
        the sender read. Returns the answer for the sender. Caller holds the lock."""
        if conn.checksum and not r.mismatch and r.summed_pages != r.landed_pages:
            missing = r.landed_pages - r.summed_pages
            per = self.layout.num_layers   # whole pages where they add up to them, else page-layers
            unit = "pages" if not (missing % per or r.landed_pages % per) else "page-layers"
            missing, landed = (missing // per, r.landed_pages // per) if unit == "pages" else (missing, r.landed_pages)
            r.mismatch = f"{missing} of {landed} {unit} arrived without a checksum"
        if r.mismatch:
            why = f"KV integrity check failed: {r.mismatch}"
            r.corrupt = True
            self._fail(r, why)
            self.integrity_by_path[conn.path] += 1
            log.warning("kv receiver %s: room %d from sender %s at %s over %s: %s", self.worker_id, room,
                        conn.peer_id, _address(conn.addr), conn.path, why)
            return Kind.ABORT, why.encode()
        now = time.monotonic()
        r.state, r.aux, r.t_done = RoomState.SUCCESS, r.finish, now
        if r.t_first is None:
            r.t_first = now
        self._cond.notify_all()
        return Kind.DONE, b""


def _address(addr: object) -> str:
    return f"{addr[0]}:{addr[1]}" if isinstance(addr, tuple) and len(addr) >= 2 else str(addr)
