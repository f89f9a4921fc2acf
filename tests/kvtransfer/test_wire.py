import dataclasses
import json
import socket

import numpy as np
import pytest
import torch

from tandem.kvtransfer.base import Geometry, PoolLayout, Progress, TransferError
from tandem.kvtransfer.protocol.iovec import page_iov, recv_iov, send_iov
from tandem.kvtransfer.protocol.wire import (
    PROGRESS_BODY,
    VERSION,
    Channel,
    Kind,
    ProtocolError,
    ReceiverMetadata,
    parse_progress,
    progress_body,
)

LAYOUT = PoolLayout(2, 64, 4, 2, 8, "bfloat16")


SHM_ENTRY = {"path": "/dev/shm/tandem-kv-D-1-1-ab", "size": 4096 + 1024, "offset": 4096, "nonce": "00ff",
             "hostname": "node-a"}


def test_metadata_round_trip():
    meta = ReceiverMetadata("D-1", LAYOUT, "10.0.0.5", 4242, ("shm", "tcp"), progress=True,
                            entries={"shm": SHM_ENTRY, "ucx": {"port": 7, "error_handling": "peer"}})
    data = meta.to_bytes()
    assert ReceiverMetadata.from_bytes(data) == meta
    assert json.loads(data)["version"] == VERSION
    plain = ReceiverMetadata("D-2", LAYOUT, "h", 1, ("tcp",))
    assert ReceiverMetadata.from_bytes(plain.to_bytes()) == plain


def test_a_layout_from_before_page_first_pools_is_layer_first():
    old = json.loads(ReceiverMetadata("D-2", LAYOUT, "h", 1, ("tcp",)).to_bytes())
    del old["layout"]["kv_layout"]
    meta = ReceiverMetadata.from_bytes(json.dumps(old).encode())
    assert meta.layout.kv_layout == "layer_first" and not meta.layout.compatible(LAYOUT)


def test_metadata_bytes_are_the_v2_format():
    """The data paths' entries sit beside the core keys, sorted; "shm" is always there (null: none)."""
    layout = ('{"dtype":"bfloat16","head_dim":8,"kv_heads":2,"kv_layout":"page_first","num_layers":2,"num_pages":64,'
              '"page_size":4}')
    plain = ReceiverMetadata("D-2", LAYOUT, "h", 1, ("tcp",), progress=True)
    assert plain.to_bytes().decode() == ('{"backends":["tcp"],"host":"h","layout":' + layout + ',"port":1,'
                                         '"progress":true,"shm":null,"version":2,"worker_id":"D-2"}')
    shm = ReceiverMetadata("D-1", LAYOUT, "h", 1, ("shm", "tcp"), entries={"shm": SHM_ENTRY})
    assert json.loads(shm.to_bytes())["shm"] == SHM_ENTRY
    checked = ReceiverMetadata("D-2", LAYOUT, "h", 1, ("tcp",), progress=True, checksums=("xxh3", "crc32"))
    assert checked.to_bytes().decode() == ('{"backends":["tcp"],"checksums":["xxh3","crc32"],"host":"h","layout":' +
                                           layout + ',"port":1,"progress":true,"shm":null,"version":2,'
                                           '"worker_id":"D-2"}')
    assert ReceiverMetadata.from_bytes(checked.to_bytes()) == checked
    assert ReceiverMetadata.from_bytes(plain.to_bytes()).checksums == ()      # a receiver from before checksums
    with pytest.raises(TransferError, match="checksums"):
        ReceiverMetadata.from_bytes(checked.to_bytes().replace(b'["xxh3","crc32"]', b'"crc32"'))
    nixl = ReceiverMetadata("D-3", LAYOUT, "h", 1, ("nixl",), entries={"nixl": {"agent": "a"}}).to_bytes()
    assert nixl.decode().startswith('{"backends":["nixl"],"host":"h","layout":' + layout + ',"nixl":{"agent":"a"},')
    assert json.loads(nixl)["shm"] is None


@pytest.mark.parametrize("bad", [b"", b"not json", b'{"version": 99}', b'{"version": 1, "worker_id": "x"}'])
def test_bad_metadata_is_a_transfer_error(bad):
    with pytest.raises(TransferError):
        ReceiverMetadata.from_bytes(bad)


def test_channel_frames():
    a, b = socket.socketpair()
    ca, cb = Channel(a), Channel(b)
    ca.send(Kind.FINISH, 2**63 - 1, b"aux")
    ca.send(Kind.DONE, 7)
    assert cb.recv_frame() == (Kind.FINISH, 2**63 - 1, b"aux", 0)
    assert cb.recv_frame() == (Kind.DONE, 7, b"", 0)
    ca.close()
    ca.close()
    with pytest.raises(ConnectionError):
        cb.recv_frame()
    cb.close()


def test_a_run_of_a_page_first_pool_is_one_piece():
    """Every layer: one iovec per run (layer-first: one per run per (layer, K|V)); some layers: one per
    page, at the layers' offset within it."""
    layer_first = PoolLayout(2, 64, 4, 2, 8, "bfloat16", "layer_first")
    starts, lengths = np.array([3, 40]), np.array([5, 1])
    block = LAYOUT.geometry().page_stride
    assert block == 2 * 2 * LAYOUT.page_bytes
    assert page_iov(1000, LAYOUT.geometry(), starts, lengths).tolist() == [[1000 + 3 * block, 5 * block],
                                                                            [1000 + 40 * block, block]]
    assert len(page_iov(1000, layer_first.geometry(), starts, lengths)) == 2 * 2 * 2
    some = page_iov(0, LAYOUT.geometry((1, 2)), starts, lengths)
    assert some.tolist() == [[p * block + 2 * LAYOUT.page_bytes, 2 * LAYOUT.page_bytes] for p in (3, 4, 5, 6, 7, 40)]


@pytest.mark.parametrize("native", [True, False])
def test_scatter_gather_moves_runs_between_pools(native):
    """Gather runs from one pool, scatter into other pages of another: 3000 iovecs (several IOV_MAX
    chunks) of odd sizes, through a socketpair with small buffers so transfers come back partial."""
    rng = np.random.default_rng(0)
    src = torch.from_numpy(rng.integers(0, 256, 64 * 3000, dtype=np.uint8))
    dst = torch.zeros_like(src)
    a, b = socket.socketpair()
    for s in (a, b):
        s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    pages = rng.permutation(3000)
    pieces = Geometry(offset=0, regions=1, region_stride=0, piece=64, page_stride=64)
    lengths = np.ones(3000, dtype=np.int64)
    send = page_iov(src.data_ptr(), pieces, np.arange(3000), lengths)
    recv = page_iov(dst.data_ptr(), pieces, pages, lengths)
    import threading

    t = threading.Thread(target=send_iov, args=(a, send, native))
    t.start()
    recv_iov(b, recv, native)
    t.join()
    assert torch.equal(dst.view(3000, 64)[torch.from_numpy(pages)], src.view(3000, 64))
    a.close()
    with pytest.raises(ConnectionError):
        recv_iov(b, recv[:1], native)
    b.close()


def test_progress_frame_round_trips():
    a, b = socket.socketpair()
    ca, cb = Channel(a), Channel(b)
    sent = Progress(tokens_done=512, tokens_total=1000, queued_ahead=2**40, expected_s=12.5)
    ca.send(Kind.PROGRESS, 2**63 - 1, progress_body(sent))
    kind, room, body, _ = cb.recv_frame()
    assert (kind, room, len(body)) == (Kind.PROGRESS, 2**63 - 1, PROGRESS_BODY.size)
    assert parse_progress(body, at=3.0) == dataclasses.replace(sent, at=3.0)
    ca.close()
    cb.close()


@pytest.mark.parametrize("body", [b"", PROGRESS_BODY.pack(1, 2, 3, 0.5) + b"x", PROGRESS_BODY.pack(1, 2, 3, -1.0),
                                  PROGRESS_BODY.pack(1, 2, 3, float("nan")), PROGRESS_BODY.pack(1, 2, 3, float("inf"))])
def test_a_bad_progress_body_is_a_protocol_error(body):
    with pytest.raises(ProtocolError):
        parse_progress(body, at=0.0)


def test_metadata_says_whether_the_receiver_takes_progress_reports():
    meta = ReceiverMetadata("D-3", LAYOUT, "h", 1, ("tcp",), progress=True)
    assert ReceiverMetadata.from_bytes(meta.to_bytes()).progress
    # A receiver from before PROGRESS does not say: its senders must not send it any.
    old = json.loads(meta.to_bytes())
    del old["progress"]
    assert not ReceiverMetadata.from_bytes(json.dumps(old).encode()).progress
