"""Every backend, receiver in a separate (spawned) process, sender here."""

from __future__ import annotations

import dataclasses
import json
import os
import random
import threading
import time

import pytest

from tandem.kvtransfer import cleanup_stale_segments, create_receiver, create_sender
from tandem.kvtransfer.base import Progress, RoomState, TransferError
from tests.kvtransfer.helpers import BIGGER, SMALL, Child, page_bytes, random_pool, uid, wait_done, wait_until

BACKENDS = ["shm", "tcp", "auto", "nixl", "ucx"]
PATH_OF = {"shm": "shm", "tcp": "tcp", "auto": "shm", "nixl": "nixl", "ucx": "ucx"}   # data path each one picks here
pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def child():
    c = Child()
    yield c
    c.stop()


class Pair:
    """A receiver in the child and a sender here, connected."""

    def __init__(self, child: Child, backend: str, layout, seed: int = 1, rx_layout=None):
        self.child, self.layout = child, layout
        self.rx_id, self.tx_id = uid("D"), uid("P")
        self.meta = child.call("receiver", self.rx_id, backend, rx_layout or layout, self.rx_id)
        self.rx = child.remote(self.rx_id)
        self.pool = random_pool(layout, seed)
        self.tx = create_sender(backend, self.pool, layout, self.tx_id)
        self.tx.connect(self.rx_id, self.meta)

    def send_room(self, src: list[int], dst: list[int], aux: bytes = b"aux", chunks: int = 1) -> int:
        room = random.getrandbits(63)
        self.rx.expect(room, dst, self.tx_id)
        step = -(-len(src) // chunks) if src else 1
        for i in range(0, len(src), step):
            self.tx.write(self.rx_id, room, src[i:i + step], dst[i:i + step])
        self.tx.finish(self.rx_id, room, aux)
        return room

    def close(self) -> None:
        self.tx.close()
        self.rx.close()


@pytest.fixture(params=BACKENDS)
def backend(request) -> str:
    return request.param


def _scatter(n: int, num_pages: int, seed: int) -> tuple[list[int], list[int]]:
    rng = random.Random(seed)
    src = list(range(10, 15)) + rng.sample([p for p in range(num_pages) if not 10 <= p < 15], n - 5)
    dst = list(range(40, 45)) + rng.sample([p for p in range(num_pages) if not 40 <= p < 45], n - 5)
    return src, dst


@pytest.mark.parametrize("kv_layout", ["page_first", "layer_first"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_scattered_pages_arrive_bit_exact(child, backend, dtype, kv_layout):
    layout = dataclasses.replace(SMALL, dtype=dtype, kv_layout=kv_layout)
    p = Pair(child, backend, layout)
    try:
        assert p.tx.path_kind(p.rx_id) == PATH_OF[backend]
        src, dst = _scatter(24, layout.num_pages, seed=0)
        room = p.send_room(src, dst, aux=b"\x08\x01first-token")
        st = wait_done(lambda: p.tx.status(room))
        rst = p.child.call("wait", p.rx_id, room)
        assert st.state == RoomState.SUCCESS, st
        assert rst.state == RoomState.SUCCESS and rst.aux == b"\x08\x01first-token", rst
        expected_bytes = len(src) * layout.num_layers * 2 * layout.page_bytes
        assert st.bytes_moved == rst.bytes_moved == expected_bytes
        assert st.seconds > 0 and rst.seconds >= 0
        assert p.rx.pages(dst) == page_bytes(p.pool, src, p.layout)
        untouched = [q for q in range(layout.num_pages) if q not in dst]
        zero = bytes(len(page_bytes(p.pool, [0], p.layout)[0]))
        assert set(p.rx.pages(untouched)) == {zero}
    finally:
        p.close()


def test_long_and_short_runs_arrive_bit_exact(child, backend):
    """Runs long enough to go pool to pool (ucx: >= 256 KiB per layer-K piece) beside scattered pages
    that fill more than one 8 MiB staging message."""
    p = Pair(child, backend, BIGGER)
    try:
        rng = random.Random(4)
        src = list(range(0, 40)) + rng.sample(range(40, 256), 160)
        dst = list(range(216, 256)) + rng.sample(range(0, 216), 160)
        room = p.send_room(src, dst)
        assert wait_done(lambda: p.tx.status(room)).state == RoomState.SUCCESS
        rst = p.child.call("wait", p.rx_id, room)
        assert rst.state == RoomState.SUCCESS and rst.bytes_moved == len(src) * 8 * BIGGER.page_bytes
        assert p.rx.pages(dst) == page_bytes(p.pool, src, p.layout)
    finally:
        p.close()


def test_chunked_writes_then_finish(child, backend):
    p = Pair(child, backend, SMALL)
    try:
        src, dst = _scatter(20, SMALL.num_pages, seed=1)
        room = p.send_room(src, dst, chunks=4)
        empty = p.send_room([], [], aux=b"all cached")         # nothing to move: aux alone completes it
        for r in (room, empty):
            assert wait_done(lambda r=r: p.tx.status(r)).state == RoomState.SUCCESS
            assert p.child.call("wait", p.rx_id, r).state == RoomState.SUCCESS
        assert p.rx.pages(dst) == page_bytes(p.pool, src, p.layout)
        assert p.rx.poll(empty).aux == b"all cached" and p.rx.poll(empty).bytes_moved == 0
        with pytest.raises(ValueError):
            p.tx.write(p.rx_id, room, [1], [2])                  # after finish: a caller bug
    finally:
        p.close()


def test_progress_reports_share_the_control_connection(child, backend):
    """Every backend delivers PROGRESS (the shared control connection), between and beside writes."""
    p = Pair(child, backend, SMALL)
    try:
        room = random.getrandbits(63)
        p.rx.expect(room, [40, 41], p.tx_id)
        p.tx.progress(p.rx_id, room, Progress(tokens_done=0, tokens_total=8, queued_ahead=3, expected_s=1.5))
        assert wait_until(lambda: p.rx.poll(room).progress is not None)
        p.tx.write(p.rx_id, room, [1], [40])
        p.tx.progress(p.rx_id, room, Progress(tokens_done=4, tokens_total=8, queued_ahead=0, expected_s=0.25))
        assert wait_until(lambda: p.rx.poll(room).progress.tokens_done == 4)
        got = p.rx.poll(room).progress
        assert (got.tokens_total, got.queued_ahead, got.expected_s) == (8, 0, 0.25) and got.at > 0
        p.tx.write(p.rx_id, room, [2], [41])
        p.tx.finish(p.rx_id, room, b"aux")
        assert p.child.call("wait", p.rx_id, room).state == RoomState.SUCCESS
        assert p.rx.pages([40, 41]) == page_bytes(p.pool, [1, 2], p.layout)
    finally:
        p.close()


def test_64_concurrent_rooms_interleaved(child, backend):
    layout = dataclasses.replace(SMALL, num_pages=256)
    p = Pair(child, backend, layout)
    try:
        rng = random.Random(2)
        src_all, dst_all = rng.sample(range(256), 256), rng.sample(range(256), 256)
        rooms = {rng.getrandbits(63): (src_all[4 * i:4 * i + 4], dst_all[4 * i:4 * i + 4]) for i in range(64)}
        for room, (_, dst) in rooms.items():
            p.rx.expect(room, dst, p.tx_id)

        def writer(my_rooms):
            for half in (slice(0, 2), slice(2, 4)):            # chunk 1 of every room, then chunk 2
                for room in my_rooms:
                    src, dst = rooms[room]
                    p.tx.write(p.rx_id, room, src[half], dst[half])
            for room in my_rooms:
                p.tx.finish(p.rx_id, room, room.to_bytes(8, "little"))

        keys = list(rooms)
        threads = [threading.Thread(target=writer, args=(keys[i::2],)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for room in rooms:
            assert wait_done(lambda room=room: p.tx.status(room)).state == RoomState.SUCCESS
            rst = p.child.call("wait", p.rx_id, room)
            assert rst.state == RoomState.SUCCESS and rst.aux == room.to_bytes(8, "little")
        src = [s for room in rooms for s in rooms[room][0]]
        dst = [d for room in rooms for d in rooms[room][1]]
        assert p.rx.pages(dst) == page_bytes(p.pool, src, p.layout)
    finally:
        p.close()


def _flush(p: Pair) -> None:
    """Complete one more room on the same connection: everything queued before it has been handled."""
    room = p.send_room([0], [BIGGER.num_pages - 1])
    assert wait_done(lambda: p.tx.status(room)).state == RoomState.SUCCESS
    assert p.child.call("wait", p.rx_id, room).state == RoomState.SUCCESS


ROUNDS = 10           # each page is written ROUNDS times: ~2000 queued jobs, so aborts land mid-stream


def _stream(p: Pair, room: int, src: list[int], dst: list[int]) -> None:
    for _ in range(ROUNDS):
        for s, d in zip(src, dst, strict=True):
            p.tx.write(p.rx_id, room, [s], [d])


def test_sender_abort_mid_transfer(child, backend):
    p = Pair(child, backend, BIGGER)
    try:
        src, dst = list(range(200)), list(range(200))
        old = page_bytes(p.pool, src, p.layout)
        room = random.getrandbits(63)
        p.rx.expect(room, dst, p.tx_id)
        _stream(p, room, src, dst)
        assert wait_until(lambda: p.rx.poll(room).state == RoomState.TRANSFERRING)
        p.tx.abort(room)
        # P may reuse its pages as soon as abort() returns: new bytes must never reach D.
        p.pool.copy_(random_pool(BIGGER, seed=99))
        _stream(p, room, src, dst)                               # ignored: the room failed
        assert p.tx.status(room).state == RoomState.FAILED
        assert p.child.call("wait", p.rx_id, room).state == RoomState.FAILED
        assert "aborted by sender" in p.rx.poll(room).error
        _flush(p)
        zero = bytes(len(old[0]))
        got = p.rx.pages(dst)
        assert all(g in (o, zero) for g, o in zip(got, old, strict=True))
        assert any(g == o for g, o in zip(got, old, strict=True))   # it was mid-transfer
    finally:
        p.close()


def test_receiver_abort_mid_transfer(child, backend):
    p = Pair(child, backend, BIGGER)
    try:
        src, dst = list(range(200)), list(range(200))
        room = random.getrandbits(63)
        p.rx.expect(room, dst, p.tx_id)
        _stream(p, room, src, dst)
        landed, snapshot = p.rx.abort_and_snapshot(room, dst)
        assert landed > 0
        assert p.rx.poll(room).state == RoomState.FAILED
        st = wait_done(lambda: p.tx.status(room))
        assert st.state == RoomState.FAILED and "aborted by receiver" in st.error
        p.tx.finish(p.rx_id, room, b"late")                     # dropped: the room failed on P
        _flush(p)
        assert p.rx.pages(dst) == snapshot                      # nothing landed after abort() returned
        assert p.rx.poll(room).state == RoomState.FAILED
    finally:
        p.close()


def test_abort_before_sender_connects(child, backend):
    """D aborts a room before P ever connected: P learns it in the handshake and writes nothing."""
    rx_id, tx_id = uid("D"), uid("P")
    meta = child.call("receiver", rx_id, backend, SMALL, rx_id)
    rx = child.remote(rx_id)
    pool = random_pool(SMALL, 3)
    tx = create_sender(backend, pool, SMALL, tx_id)
    try:
        room = random.getrandbits(63)
        rx.expect(room, [5, 6], tx_id)
        rx.abort(room)
        tx.connect(rx_id, meta)
        assert tx.status(room).state == RoomState.FAILED
        tx.write(rx_id, room, [1, 2], [5, 6])
        tx.finish(rx_id, room, b"x")
        zero = bytes(len(page_bytes(pool, [0], SMALL)[0]))
        assert rx.pages([5, 6]) == [zero, zero]
    finally:
        tx.close()
        rx.close()


@pytest.mark.timeout(90)
def test_peer_killed_mid_transfer_then_reuse(child):
    """One victim process per direction and backend: it hosts a receiver we write to and a sender that
    writes to us. SIGKILL it mid-transfer: both sides' rooms fail quickly; then new rooms work."""
    victim = Child()
    ours = []                      # (backend, sender, rx_id, room, receiver, room2, victim receiver key)
    try:
        for backend in BACKENDS:
            vrx = uid(f"Dv-{backend}")
            meta = victim.call("receiver", vrx, backend, BIGGER, vrx)
            tx_id = uid("P")
            tx = create_sender(backend, random_pool(BIGGER, 4), BIGGER, tx_id)
            tx.connect(vrx, meta)
            room = random.getrandbits(63)
            victim.call("call", vrx, "expect", room, list(range(256)), tx_id)
            for i in range(256):
                tx.write(vrx, room, [i], [i])

            rx_id, vtx = uid(f"Dp-{backend}"), uid(f"Pv-{backend}")
            rx = create_receiver(backend, BIGGER, "127.0.0.1", rx_id)
            room2 = random.getrandbits(63)
            rx.expect(room2, list(range(256)), vtx)
            victim.call("sender", vtx, backend, BIGGER, vtx, 5)
            victim.call("call", vtx, "connect", rx_id, rx.metadata())
            for i in range(64):
                victim.call("call", vtx, "write", rx_id, room2, [i], [i])
            assert wait_until(lambda rx=rx, room2=room2: rx.poll(room2).state == RoomState.TRANSFERRING)
            ours.append((backend, tx, vrx, room, rx, room2))
        segments = [victim.call("segment_path", vrx) for b, _, vrx, *_ in ours if PATH_OF[b] == "shm"]
        victim.kill()
        t0 = time.monotonic()
        for backend, tx, _, room, rx, room2 in ours:
            st = wait_done(lambda tx=tx, room=room: tx.status(room), timeout=10)
            assert st.state == RoomState.FAILED and "lost" in st.error, (backend, st)
            rst = wait_done(lambda rx=rx, room2=room2: rx.poll(room2), timeout=10)
            assert rst.state == RoomState.FAILED and "lost" in rst.error, (backend, rst)
        assert time.monotonic() - t0 < 5.0
        # The victim's shared-memory segments leaked; the helper removes them (their pid is dead).
        removed = cleanup_stale_segments()
        assert set(segments) <= set(removed) and not any(os.path.exists(s) for s in segments)
        # Reuse: the same senders reach a new receiver.
        for backend, tx, vrx, *_ in ours:
            assert not tx.has_peer(vrx)
            rx_id = uid("Dnew")
            meta = child.call("receiver", rx_id, backend, BIGGER, rx_id)
            tx.connect(rx_id, meta)
            room = random.getrandbits(63)
            child.call("call", rx_id, "expect", room, [7, 8], tx.worker_id)
            tx.write(rx_id, room, [1, 2], [7, 8])
            tx.finish(rx_id, room, b"again")
            assert wait_done(lambda tx=tx, room=room: tx.status(room)).state == RoomState.SUCCESS
            assert child.call("wait", rx_id, room).aux == b"again"
            child.call("call", rx_id, "close")
    finally:
        victim.stop()
        for _, tx, _, _, rx, _ in ours:
            tx.close()
            rx.close()


def test_close_twice_is_safe(backend):
    rx = create_receiver(backend, SMALL, "127.0.0.1", uid("D"))
    tx = create_sender(backend, random_pool(SMALL, 0), SMALL, uid("P"))
    tx.connect(rx.worker_id, rx.metadata())
    shm = json.loads(rx.metadata())["shm"]
    rx.expect(1, [0], tx.worker_id)
    tx.close()
    tx.close()
    assert wait_done(lambda: rx.poll(1)).state == RoomState.FAILED     # its sender went away
    rx.close()
    rx.close()
    if shm:
        assert not os.path.exists(shm["path"])
    with pytest.raises(TransferError):
        rx.expect(2, [1], "P")
    with pytest.raises(TransferError):
        tx.write(rx.worker_id, 3, [0], [0])


def _threads_of(*worker_ids: str) -> list[str]:
    return [t.name for t in threading.enumerate() if any(w in t.name for w in worker_ids)]


def test_close_from_two_threads_fails_open_rooms_and_leaves_no_thread(backend):
    """One teardown for every backend (kvtransfer/base.py RoomTable.close): concurrent and repeated
    closes tear down once, unfinished rooms fail, every connection thread and data path goes."""
    rx = create_receiver(backend, SMALL, "127.0.0.1", uid("D"))
    pool = random_pool(SMALL, 0)
    tx = create_sender(backend, pool, SMALL, uid("P"))
    tx.connect(rx.worker_id, rx.metadata())
    assert _threads_of(rx.worker_id) and _threads_of(tx.worker_id)
    done, open_ = random.getrandbits(63), random.getrandbits(63)
    for room in (done, open_):
        rx.expect(room, [room % SMALL.num_pages], tx.worker_id)
        tx.write(rx.worker_id, room, [1], [room % SMALL.num_pages])
    tx.finish(rx.worker_id, done, b"aux")
    assert wait_done(lambda: tx.status(done)).state == RoomState.SUCCESS
    assert wait_until(lambda: rx.poll(open_).state == RoomState.TRANSFERRING)
    for side in (rx, tx):
        closers = [threading.Thread(target=side.close) for _ in range(2)]
        for t in closers:
            t.start()
        for t in closers:
            t.join(30)
        side.close()
        if side is rx:      # the receiver went first: the sender sees its connection end
            st = wait_done(lambda: tx.status(open_))
            assert st.state == RoomState.FAILED and "lost" in st.error, st
    assert rx.poll(done).state == tx.status(done).state == RoomState.SUCCESS    # finished rooms stay as they were
    assert rx.poll(open_).state == RoomState.FAILED and rx.poll(open_).error == "receiver closed"
    assert wait_until(lambda: not _threads_of(rx.worker_id, tx.worker_id), 5.0), _threads_of(rx.worker_id)
    for side in (rx, tx):
        side.release(done)
        side.release(open_)                                    # after close: forgets, nothing to abort
    with pytest.raises(KeyError):
        rx.poll(open_)


def test_layout_mismatch_is_rejected(child, backend):
    rx_id = uid("D")
    meta = child.call("receiver", rx_id, backend, SMALL, rx_id)
    try:
        other = dataclasses.replace(SMALL, head_dim=16)
        tx = create_sender(backend, random_pool(other, 0), other, uid("P"))
        with pytest.raises(TransferError, match="incompatible"):
            tx.connect(rx_id, meta)                               # caught from the metadata
        # Metadata that lies about the layout: the receiver's hello check rejects the connection.
        lie = json.loads(meta)
        lie["layout"]["head_dim"] = 16
        lie["backends"] = [b for b in lie["backends"] if b == "tcp"] or lie["backends"]
        with pytest.raises(TransferError):
            tx.connect(rx_id, json.dumps(lie).encode())
        assert not tx.has_peer(rx_id)
        tx.close()
    finally:
        child.call("call", rx_id, "close")


@pytest.mark.parametrize("two_sided", ["tcp", "ucx"])
def test_write_for_unknown_room_is_discarded(child, two_sided):
    """Backends where D receives the bytes itself drop a write D does not expect, and go on."""
    p = Pair(child, two_sided, SMALL)
    try:
        room = random.getrandbits(63)                           # never expected (or already released)
        p.tx.write(p.rx_id, room, [1, 2, 3], [4, 5, 6])
        p.tx.finish(p.rx_id, room, b"x")
        st = wait_done(lambda: p.tx.status(room))
        assert st.state == RoomState.FAILED and "unknown room" in st.error
        zero = bytes(len(page_bytes(p.pool, [0], p.layout)[0]))
        assert p.rx.pages([4, 5, 6]) == [zero] * 3
        src, dst = _scatter(8, SMALL.num_pages, seed=5)          # the connection is still fine
        ok = p.send_room(src, dst)
        assert wait_done(lambda: p.tx.status(ok)).state == RoomState.SUCCESS
    finally:
        p.close()
