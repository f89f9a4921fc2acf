"""KV integrity on every backend: corruption injected in flight is always caught, never a false alarm;
old peers stay explicit; a receiver does not take unchecked pages from a sender that announced checksums."""

from __future__ import annotations

import json
import logging
import random
import socket

import numpy as np
import pytest

from tandem.kvtransfer import create_receiver, create_sender
from tandem.kvtransfer.base import RoomState
from tandem.kvtransfer.protocol import checksum, handshake
from tandem.kvtransfer.protocol.wire import HEADER, Channel, Kind, Timeouts
from tests.kvtransfer.helpers import SMALL, page_bytes, random_pool, uid, wait_done, wire_bytes

pytestmark = pytest.mark.timeout(120)

TRANSFERS = 1500             # about 1,050 of them corrupted, 450 clean
IN_FLIGHT = 16               # rooms at once, 4 destination pages each (SMALL has 64)


@pytest.mark.parametrize("backend, checksums", [("tcp", None), ("shm", None), ("nixl", None), ("ucx", None),
                                                ("tcp", ("xxh3", "crc32")), ("shm", ("xxh3", "crc32"))],
                         ids=["tcp", "shm", "nixl", "ucx", "tcp-threads", "shm-threads"])
def test_every_corrupted_transfer_is_caught_and_no_clean_one_is_flagged(backend, checksums):
    """1,500 rooms, 70% of them drawn to have a byte flipped on the way (after P took its checksum):
    every drawn room FAILS as corrupt on both sides, every other one SUCCEEDS with exact bytes. With
    the best checksum (crc32c where native: tcp and shm compute it on the way) and with the ones
    computed on the checksum threads."""
    rng = random.Random(11)
    drawn = {room for room in range(1, TRANSFERS + 1) if rng.random() < 0.7}
    rx = create_receiver(backend, SMALL, "127.0.0.1", uid("D"))
    pool = random_pool(SMALL, 3)
    tx = create_sender(backend, pool, SMALL, uid("P"), corrupt=drawn.__contains__, checksums=checksums)
    detected, false_alarms, clean = set(), set(), 0
    try:
        tx.connect(rx.worker_id, rx.metadata())
        slots = [list(range(4 * i, 4 * i + 4)) for i in range(IN_FLIGHT)]
        for first in range(1, TRANSFERS + 1, IN_FLIGHT):
            batch = {}
            for room, dst in zip(range(first, min(first + IN_FLIGHT, TRANSFERS + 1)), slots, strict=False):
                src = rng.sample(range(SMALL.num_pages), rng.randint(1, 4))
                dst = dst[:len(src)]
                rx.expect(room, dst, tx.worker_id)
                tx.write(rx.worker_id, room, src, dst)
                tx.finish(rx.worker_id, room, b"aux")
                batch[room] = (src, dst)
            for room, (src, dst) in batch.items():
                st, pst = rx.wait(room, 30), tx.wait(room, 30)
                assert st.state.done and pst.state.done, (room, st, pst)
                if st.corrupt:
                    assert st.state is RoomState.FAILED and st.error.startswith("KV integrity check failed"), st
                    assert st.path == ("shm" if backend == "shm" else backend)
                    assert pst.state is RoomState.FAILED and "KV integrity" in pst.error, pst
                    (detected if room in drawn else false_alarms).add(room)
                else:
                    assert st.state is RoomState.SUCCESS and st.aux == b"aux", (room, st)
                    assert page_bytes(rx.buffer, dst, rx.layout) == page_bytes(pool, src, rx.layout)
                    clean += 1
                rx.release(room)
                tx.release(room)
    finally:
        tx.close()
        rx.close()
    assert len(drawn) >= 1000
    assert detected == drawn and not false_alarms and clean == TRANSFERS - len(drawn)
    assert rx.integrity_failures == len(drawn)


def _strip_checksum(meta: bytes) -> bytes:
    d = json.loads(meta)
    d.pop("checksums")
    return json.dumps(d).encode()


@pytest.mark.parametrize("old", ["sender", "receiver"])
def test_a_peer_from_before_checksums_still_transfers_unchecked(old, caplog):
    """An old sender (no checksum in its hello) or an old receiver (none in its metadata): the rooms
    complete as before, unchecked, and the side that knows says so in the log."""
    rx = create_receiver("tcp", SMALL, "127.0.0.1", uid("D"))
    pool = random_pool(SMALL, 4)
    tx = create_sender("tcp", pool, SMALL, uid("P"), checksums=() if old == "sender" else None,
                       corrupt=lambda room: room == 2)
    try:
        with caplog.at_level(logging.WARNING):
            tx.connect(rx.worker_id, rx.metadata() if old == "sender" else _strip_checksum(rx.metadata()))
            for room in (1, 2):
                rx.expect(room, [room], tx.worker_id)
                tx.write(rx.worker_id, room, [5], [room])
                tx.finish(rx.worker_id, room, b"aux")
                assert wait_done(lambda room=room: rx.poll(room)).state is RoomState.SUCCESS
        assert page_bytes(rx.buffer, [1], rx.layout) == page_bytes(pool, [5], rx.layout)
        assert page_bytes(rx.buffer, [2], rx.layout) != page_bytes(pool, [5], rx.layout)       # what checksums are for
        assert "sends no KV checksums" in caplog.text
        if old == "receiver":
            assert "checks none of the checksums" in caplog.text
    finally:
        tx.close()
        rx.close()


class RawSender:
    """A tcp sender made of frames, announcing checksums: to send what a real one never would."""

    def __init__(self, rx, layout=SMALL):
        meta = json.loads(rx.metadata())
        self.layout, self.id = layout, uid("P")
        self.ch = Channel(socket.create_connection(("127.0.0.1", meta["port"])))
        handshake.open_connection(self.ch, key=None, sender_id=self.id, epoch=0, receiver_id=rx.worker_id,
                                  path="tcp", layout=layout, timeouts=Timeouts(), checksum="crc32")
        self.pool = random_pool(layout, 9)

    def write(self, room: int, start: int, n: int) -> None:
        body = np.array([[start, n]], dtype="<i8").tobytes()
        payload = wire_bytes(self.pool, self.layout, [(start, n)])
        self.ch.sock.sendall(HEADER.pack(Kind.WRITE, len(body), room, len(payload)) + body + payload)

    def sums(self, room: int, start: int, n: int) -> None:
        runs = np.array([[start, n]], dtype=np.int64)
        value = checksum.pages_sum(checksum.page_view(self.pool, self.layout), runs, "crc32")
        self.ch.send(Kind.SUMS, room, checksum.sums_body(runs, value))

    def finish(self, room: int) -> None:
        self.ch.send(Kind.FINISH, room, b"aux")


@pytest.mark.parametrize("case", ["checked", "no_sums", "other_pages"])
def test_every_page_from_a_checking_sender_must_be_checked(case):
    rx = create_receiver("tcp", SMALL, "127.0.0.1", uid("D"))
    p = RawSender(rx)
    try:
        rx.expect(1, [3, 4, 5], p.id)
        p.write(1, 3, 2)
        if case == "checked":
            p.sums(1, 3, 2)
        elif case == "other_pages":
            p.sums(1, 4, 2)
        p.finish(1)
        st = rx.wait(1, 10)
        if case == "checked":
            assert st.state is RoomState.SUCCESS and not st.corrupt
        else:
            assert st.state is RoomState.FAILED and st.corrupt, st
            assert {"no_sums": "2 of 2 pages arrived without a checksum",
                    "other_pages": "checksums for other pages"}[case] in st.error
    finally:
        p.ch.close()
        rx.close()
