"""Registry, auto's choice of path, shared-memory housekeeping (in one process)."""

import json
import os
import subprocess
import sys

import pytest

import kvtransfer
from kvtransfer import cleanup_stale_segments, create_receiver, create_sender
from kvtransfer.backends.shm import PREFIX, Segment
from kvtransfer.base import RoomState, TransferError
from tests.kvtransfer.helpers import SMALL, page_bytes, random_pool, uid, wait_done

pytestmark = pytest.mark.timeout(60)


def test_unknown_backend_lists_the_known_ones():
    with pytest.raises(ValueError, match="auto, nixl, shm, tcp, ucx"):
        create_receiver("rdma", SMALL, "127.0.0.1", "D")
    with pytest.raises(ValueError, match="auto, nixl, shm, tcp, ucx"):
        create_sender("rdma", random_pool(SMALL, 0), SMALL, "P")


def test_importing_kvtransfer_loads_neither_nixl_nor_ucxx():
    code = ("import os, sys, kvtransfer; "
            "assert not {'nixl', 'nixl_cu12', 'ucxx'} & set(sys.modules), sorted(sys.modules); "
            "assert not any(k.startswith('UCX_') for k in os.environ)")
    env = {k: v for k, v in os.environ.items() if not k.startswith("UCX_")}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, cwd=os.path.dirname(kvtransfer.__path__[0]))


def test_sender_rejects_a_pool_that_does_not_match_its_layout():
    with pytest.raises(ValueError):
        create_sender("tcp", random_pool(SMALL, 0)[:1], SMALL, "P")


def test_metadata_of_auto_carries_both_paths():
    rx = create_receiver("auto", SMALL, "127.0.0.1", "D-meta")
    try:
        meta = json.loads(rx.metadata())
        assert meta["backends"] == ["shm", "tcp"] and meta["port"] > 0 and meta["host"] == "127.0.0.1"
        assert meta["shm"]["path"].startswith(f"/dev/shm/{PREFIX}D_meta-{os.getpid()}-")
        assert rx.buffer.shape == SMALL.shape and not rx.buffer.any()
    finally:
        rx.close()


def test_auto_falls_back_to_tcp_when_the_receiver_is_on_another_host():
    rx = create_receiver("auto", SMALL, "127.0.0.1", uid("D"))
    pool = random_pool(SMALL, 0)
    tx = create_sender("auto", pool, SMALL, uid("P"))
    shm_only = create_sender("shm", pool, SMALL, uid("P"))
    try:
        meta = json.loads(rx.metadata())
        meta["shm"]["hostname"] = "some-other-node"
        elsewhere = json.dumps(meta).encode()
        tx.connect(rx.worker_id, elsewhere)
        assert tx.path_kind(rx.worker_id) == "tcp"
        with pytest.raises(TransferError, match="host"):
            shm_only.connect(rx.worker_id, elsewhere)
        rx.expect(9, [3, 4], tx.worker_id)
        tx.write(rx.worker_id, 9, [0, 1], [3, 4])
        tx.finish(rx.worker_id, 9, b"ok")
        assert wait_done(lambda: tx.status(9)).state == RoomState.SUCCESS
        assert page_bytes(rx.buffer, [3, 4]) == page_bytes(pool, [0, 1])
    finally:
        tx.close()
        shm_only.close()
        rx.close()


def test_tcp_sender_cannot_use_an_shm_only_receiver():
    rx = create_receiver("shm", SMALL, "127.0.0.1", uid("D"))
    tx = create_sender("tcp", random_pool(SMALL, 0), SMALL, uid("P"))
    try:
        with pytest.raises(TransferError, match="not offered"):
            tx.connect(rx.worker_id, rx.metadata())
    finally:
        tx.close()
        rx.close()


def test_cleanup_removes_only_segments_of_dead_owners(tmp_path):
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = tmp_path / f"{PREFIX}D_x-{dead.pid}-abcd"
    live = tmp_path / f"{PREFIX}D_y-{os.getpid()}-abcd"
    other = tmp_path / "someone-else-1-2"
    for f in (stale, live, other):
        f.write_bytes(b"x")
    assert cleanup_stale_segments(str(tmp_path)) == [str(stale)]
    assert not stale.exists() and live.exists() and other.exists()


def test_segment_refuses_a_file_that_is_not_the_advertised_one(tmp_path):
    seg = Segment.create(SMALL, "D-seg", directory=str(tmp_path))
    try:
        info = seg.info()
        Segment.open(info, SMALL)
        with pytest.raises(TransferError, match="advertised"):
            Segment.open(type(info)(**{**info.__dict__, "nonce": "00" * 16}), SMALL)
    finally:
        seg.unlink()
    assert not os.path.exists(info.path)
