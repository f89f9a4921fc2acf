"""Who may write into a receiver's pool: the handshake's proof of the shared secret, and the binding of
each room to its sender, its instance and its pages (real sockets on 127.0.0.1, tcp and shm)."""

import dataclasses
import logging
import socket

import pytest

from tandem.kvtransfer import create_receiver, create_sender
from tandem.kvtransfer.base import RoomState, TransferError
from tandem.kvtransfer.protocol.handshake import CHALLENGE_BYTES, _proof
from tandem.kvtransfer.protocol.wire import HEADER, VERSION, Channel, Kind, ReceiverMetadata, dumps, loads
from tests.kvtransfer.helpers import SMALL, page_bytes, random_pool, uid, wait_done

pytestmark = pytest.mark.timeout(60)

KEY = b"k" * 32
OTHER_KEY = b"o" * 32
BACKENDS = ["tcp", "shm"]


@pytest.fixture
def pair(request):
    """(make_receiver, make_sender) that close what they made."""
    made = []

    def rx(backend, key=KEY):
        r = create_receiver(backend, SMALL, "127.0.0.1", uid("D"), secret=key)
        made.append(r)
        return r

    def tx(backend, key=KEY, worker_id=None, epoch=0, seed=1):
        s = create_sender(backend, random_pool(SMALL, seed), SMALL, worker_id or uid("P"), secret=key,
                          boot_epoch=epoch)
        made.append(s)
        return s

    yield rx, tx
    for x in reversed(made):
        x.close()


def _connected(pair, backend):
    rx_, tx_ = pair
    rx, tx = rx_(backend), tx_(backend)
    tx.connect(rx.worker_id, rx.metadata())
    return rx, tx


def _move(tx, rx, room, src, dst):
    tx.write(rx.worker_id, room, src, dst)
    tx.finish(rx.worker_id, room, b"aux")


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_sender_with_the_key_transfers(pair, backend):
    rx, tx = _connected(pair, backend)
    rx.expect(7, [3, 4], tx.worker_id)
    _move(tx, rx, 7, [10, 11], [3, 4])
    assert wait_done(lambda: rx.poll(7)).state == RoomState.SUCCESS
    assert page_bytes(rx.buffer, [3, 4], rx.layout) == page_bytes(tx._buffer, [10, 11], tx.layout)
    assert rx.refusals.count == 0


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("sender_key", [None, OTHER_KEY], ids=["no-key", "wrong-key"])
def test_a_sender_without_the_key_is_refused_and_logged(pair, backend, sender_key, caplog):
    rx_, tx_ = pair
    rx, tx = rx_(backend), tx_(backend, key=sender_key)
    with caplog.at_level(logging.WARNING, logger="tandem.kvtransfer.protocol.handshake"):
        with pytest.raises(TransferError, match="refused the connection: the sender"):
            tx.connect(rx.worker_id, rx.metadata())
    assert rx.refusals.count == 1 and not tx.has_peer(rx.worker_id)
    assert "refused" in caplog.text and KEY.decode() not in caplog.text


def test_a_sender_with_the_key_refuses_a_receiver_without_it(pair):
    rx_, tx_ = pair
    rx, tx = rx_("tcp", key=None), tx_("tcp")
    with pytest.raises(TransferError, match="could not prove the shared secret"):
        tx.connect(rx.worker_id, rx.metadata())


def test_a_hello_recorded_on_one_connection_is_refused_on_another(pair):
    """Replay: the proof covers the receiver's fresh challenge, so a copied hello is worthless."""
    rx_, _ = pair
    rx = rx_("tcp")
    meta = ReceiverMetadata.from_bytes(rx.metadata())

    def hello_on_new_connection(proof_challenge=None) -> dict:
        ch = Channel(socket.create_connection((meta.host, meta.port), timeout=5))
        try:
            kind, _, challenge, _ = ch.recv_frame()
            assert kind == Kind.CHALLENGE and len(challenge) == CHALLENGE_BYTES
            signed = challenge if proof_challenge is None else proof_challenge
            hello = {"version": VERSION, "worker_id": "P-x", "epoch": 0, "path": "tcp", "nonce": "n",
                     "layout": dataclasses.asdict(SMALL),
                     "proof": _proof(KEY, "hello", signed, "n", rx.worker_id, "P-x", 0, "tcp")}
            body = dumps(hello)
            ch.sock.sendall(HEADER.pack(Kind.HELLO, len(body), 0, 0) + body)
            kind, _, ack, _ = ch.recv_frame()
            assert kind == Kind.HELLO_ACK
            return {**loads(ack), "challenge": challenge}
        finally:
            ch.close()

    first = hello_on_new_connection()
    assert first["ok"], first
    replayed = hello_on_new_connection(proof_challenge=first["challenge"])
    assert not replayed["ok"] and "proof of the shared secret is wrong" in replayed["error"]


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_write_from_a_sender_the_room_was_not_paired_with_is_refused(pair, backend):
    rx_, tx_ = pair
    rx = rx_(backend)
    good, evil = tx_(backend, seed=1), tx_(backend, seed=2)
    for tx in (good, evil):
        tx.connect(rx.worker_id, rx.metadata())
    rx.expect(5, [1, 2], good.worker_id)
    _move(evil, rx, 5, [0, 1], [1, 2])
    assert wait_done(lambda: evil.status(5)).state == RoomState.FAILED
    assert rx.poll(5).state == RoomState.WAITING_FOR_INPUT      # the paired sender's room is untouched
    assert rx.refusals.count >= 1
    if backend == "tcp":                                         # two-sided: nothing landed
        assert not rx.layout.by_page(rx.buffer)[1:3].any()
    _move(good, rx, 5, [20, 21], [1, 2])
    assert wait_done(lambda: rx.poll(5)).state == RoomState.SUCCESS
    assert page_bytes(rx.buffer, [1, 2], rx.layout) == page_bytes(good._buffer, [20, 21], good.layout)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_write_outside_the_rooms_pages_is_refused(pair, backend):
    rx, tx = _connected(pair, backend)
    rx.expect(9, [4, 5], tx.worker_id)
    rx.expect(10, [6], tx.worker_id)                             # another room's page
    _move(tx, rx, 9, [1, 2], [5, 6])
    st = wait_done(lambda: rx.poll(9))
    assert st.state == RoomState.FAILED and "outside the room's destination pages" in st.error
    assert rx.refusals.count == 1
    if backend == "tcp":
        assert not rx.layout.by_page(rx.buffer)[6].any()                      # room 10's page was not written
    assert wait_done(lambda: tx.status(9)).state == RoomState.FAILED


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_write_from_an_earlier_instance_of_the_paired_sender_is_refused(pair, backend):
    rx_, tx_ = pair
    rx = rx_(backend)
    old = tx_(backend, worker_id="P-same", epoch=41, seed=1)
    old.connect(rx.worker_id, rx.metadata())
    rx.expect(3, [8], "P-same", peer_epoch=42)
    _move(old, rx, 3, [0], [8])
    assert wait_done(lambda: old.status(3)).state == RoomState.FAILED
    assert rx.poll(3).state == RoomState.WAITING_FOR_INPUT
    old.close()
    new = tx_(backend, worker_id="P-same", epoch=42, seed=3)
    new.connect(rx.worker_id, rx.metadata())
    _move(new, rx, 3, [30], [8])
    assert wait_done(lambda: rx.poll(3)).state == RoomState.SUCCESS
    assert page_bytes(rx.buffer, [8], rx.layout) == page_bytes(new._buffer, [30], new.layout)


def test_frames_for_a_released_room_do_not_land(pair):
    rx, tx = _connected(pair, "tcp")
    rx.expect(11, [12], tx.worker_id)
    _move(tx, rx, 11, [1], [12])
    assert wait_done(lambda: rx.poll(11)).state == RoomState.SUCCESS
    # release() forgets a finished room: the sender's room is finished once D's DONE reached it, which
    # can be after D's own room says SUCCESS (a DONE still in flight would settle the replay's room).
    assert wait_done(lambda: tx.status(11)).state == RoomState.SUCCESS
    rx.release(11)
    before = page_bytes(rx.buffer, [12], rx.layout)
    tx.release(11)
    _move(tx, rx, 11, [2], [12])                                # the same room again: a replay
    assert wait_done(lambda: tx.status(11)).state == RoomState.FAILED
    assert page_bytes(rx.buffer, [12], rx.layout) == before
