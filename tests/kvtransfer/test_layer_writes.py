"""Layer writes (WRITE_LAYERS): a room sent a few layers at a time, as a prefill worker streams it while
its forward pass runs. Only the named layers move; integrity is checked per write; a receiver or a
data path without the capability is never sent one."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from tandem.kvtransfer import create_receiver, create_sender
from tandem.kvtransfer.base import RoomState, TransferError
from tandem.kvtransfer.protocol.wire import ProtocolError, layers_body, split_layers
from tests.kvtransfer.helpers import BIGGER, BIGGER_LF, page_bytes, random_pool, uid, wait_done, wait_until

pytestmark = pytest.mark.timeout(60)

GROUPS = [(0, 1), (1, 3), (3, 4)]          # BIGGER has 4 layers


def layer_bytes(buf: torch.Tensor, pages: list[int], layers: tuple[int, int], layout=BIGGER) -> bytes:
    return layout.by_page(buf)[pages, layers[0]:layers[1]].contiguous().view(torch.uint8).numpy().tobytes()


@pytest.mark.parametrize("layout", [BIGGER, BIGGER_LF], ids=["page_first", "layer_first"])
@pytest.mark.parametrize("backend, checksums", [("tcp", None), ("tcp", ("xxh3", "crc32")), ("tcp", ()),
                                                ("nixl", None), ("nixl", ())],
                         ids=["tcp-crc32c-inline", "tcp-threads", "tcp-unchecked", "nixl", "nixl-unchecked"])
def test_a_room_sent_in_layer_groups_lands_exactly_and_only_the_layers_named(backend, checksums, layout):
    rx = create_receiver(backend, layout, "127.0.0.1", uid("D"))
    pool = random_pool(layout, 5)
    tx = create_sender(backend, pool, layout, uid("P"), checksums=checksums)
    try:
        tx.connect(rx.worker_id, rx.metadata())
        assert tx.writes_layers(rx.worker_id)
        src, dst = [3, 4, 5, 9, 200], [10, 11, 12, 40, 41]
        rx.expect(1, dst, tx.worker_id)
        for i, group in enumerate(GROUPS):
            tx.write(rx.worker_id, 1, src, dst, layers=group)
            wait_done(lambda g=group: _landed(rx, pool, src, dst, g, layout), 10)
            assert layer_bytes(rx.buffer, dst, group, layout) == layer_bytes(pool, src, group, layout)
            for later in GROUPS[i + 1:]:       # not sent yet: still the receiver's zeros
                assert not layout.by_page(rx.buffer)[dst, later[0]:later[1]].any()
            # a one-sided path's bytes land before its WROTE note says so
            assert wait_until(lambda: rx.poll(1).state is RoomState.TRANSFERRING)
        tx.finish(rx.worker_id, 1, b"aux")
        st, pst = rx.wait(1, 10), tx.wait(1, 10)
        assert st.state is RoomState.SUCCESS and st.aux == b"aux", st
        assert pst.state is RoomState.SUCCESS and pst.bytes_moved == len(src) * BIGGER.num_layers * 2 * BIGGER.page_bytes
        assert page_bytes(rx.buffer, dst, rx.layout) == page_bytes(pool, src, rx.layout)
    finally:
        tx.close()
        rx.close()


class _Landed:
    state = RoomState.SUCCESS


def _landed(rx, pool, src, dst, group, layout=BIGGER):
    """A status-like object for wait_done: done once the group's bytes are in the receiver's pool."""
    return _Landed() if layer_bytes(rx.buffer, dst, group, layout) == layer_bytes(pool, src, group, layout) \
        else rx.poll(1)


@pytest.mark.parametrize("backend, checksums", [("tcp", None), ("tcp", ("xxh3",)), ("nixl", None)],
                         ids=["tcp-crc32c-inline", "tcp-threads", "nixl"])
def test_a_layer_write_corrupted_on_the_way_fails_the_room(backend, checksums):
    rx = create_receiver(backend, BIGGER, "127.0.0.1", uid("D"))
    pool = random_pool(BIGGER, 6)
    tx = create_sender(backend, pool, BIGGER, uid("P"), corrupt=lambda room: room == 2, checksums=checksums)
    try:
        tx.connect(rx.worker_id, rx.metadata())
        for room in (1, 2):
            dst = [room * 8, room * 8 + 1]
            rx.expect(room, dst, tx.worker_id)
            for group in GROUPS:
                tx.write(rx.worker_id, room, [room, room + 20], dst, layers=group)
            tx.finish(rx.worker_id, room, b"aux")
        assert rx.wait(1, 10).state is RoomState.SUCCESS
        st, pst = rx.wait(2, 10), tx.wait(2, 10)
        assert st.state is RoomState.FAILED and st.corrupt and "KV integrity check failed" in st.error, st
        assert pst.state is RoomState.FAILED and "KV integrity" in pst.error
        assert rx.integrity_failures == 1
    finally:
        tx.close()
        rx.close()


def test_no_layer_writes_where_the_receiver_or_the_path_takes_none():
    rx = create_receiver("tcp", BIGGER, "127.0.0.1", uid("D"))
    meta = json.loads(rx.metadata())
    assert meta["layer_writes"] == ["tcp"]           # a tcp-only receiver (the default `auto` adds shm: none)
    del meta["layer_writes"]                    # a receiver from before WRITE_LAYERS
    tx = create_sender("tcp", random_pool(BIGGER, 1), BIGGER, uid("P"))
    shm_rx = create_receiver("shm", BIGGER, "127.0.0.1", uid("D"))
    shm_tx = create_sender("shm", random_pool(BIGGER, 2), BIGGER, uid("P"))
    try:
        tx.connect(rx.worker_id, json.dumps(meta, separators=(",", ":"), sort_keys=True).encode())
        assert not tx.writes_layers(rx.worker_id)
        with pytest.raises(TransferError, match="takes no layer writes"):
            tx.write(rx.worker_id, 1, [0], [0], layers=(0, 1))
        shm_tx.connect(shm_rx.worker_id, shm_rx.metadata())
        assert not shm_tx.writes_layers(shm_rx.worker_id)       # one-sided copies move whole pages
        assert not tx.writes_layers("nobody")
    finally:
        for side in (tx, rx, shm_tx, shm_rx):
            side.close()


def test_a_layer_range_outside_the_pool_is_refused_on_both_sides():
    rx = create_receiver("tcp", BIGGER, "127.0.0.1", uid("D"))
    tx = create_sender("tcp", random_pool(BIGGER, 1), BIGGER, uid("P"))
    try:
        tx.connect(rx.worker_id, rx.metadata())
        for bad in ((0, 0), (3, 5), (-1, 2)):
            with pytest.raises(ValueError, match="layers"):
                tx.write(rx.worker_id, 1, [0], [0], layers=bad)
    finally:
        tx.close()
        rx.close()
    runs = np.array([[3, 2]], dtype="<i8").tobytes()
    assert split_layers(layers_body((1, 3)) + runs, 4) == ((1, 3), runs)
    for first, end in ((2, 5), (4, 5)):
        with pytest.raises(ProtocolError):
            split_layers(layers_body((first, end)) + runs, 4)
    with pytest.raises(ProtocolError):
        split_layers(b"\x01", 4)
