"""Registry, auto's choice of path, shared-memory housekeeping (in one process)."""

import fcntl
import gc
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tandem.kvtransfer import cleanup_stale_segments, create_receiver, create_sender
from tandem.kvtransfer.base import RoomState, TransferError
from tandem.kvtransfer.protocol.shm import PREFIX, Segment
from tests.kvtransfer.helpers import SMALL, SMALL_LF, page_bytes, random_pool, uid, wait_done

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.timeout(60)


def test_unknown_backend_lists_the_known_ones():
    with pytest.raises(ValueError, match="auto, nixl, shm, tcp, ucx"):
        create_receiver("rdma", SMALL, "127.0.0.1", "D")
    with pytest.raises(ValueError, match="auto, nixl, shm, tcp, ucx"):
        create_sender("rdma", random_pool(SMALL, 0), SMALL, "P")


def test_options_reach_the_parts_that_take_them_and_nothing_else():
    with pytest.raises(TypeError, match="takes no option ucx"):
        create_receiver("tcp", SMALL, "127.0.0.1", "D", ucx=None)
    with pytest.raises(TypeError, match="takes no option require_rdma"):
        create_sender("auto", random_pool(SMALL, 0), SMALL, "P", require_rdma=True)
    # native_iov is tcp's (auto carries it to its tcp path), secret the protocol's: one round trip with both.
    rx = create_receiver("auto", SMALL, "127.0.0.1", uid("D"), native_iov=False, secret=b"k" * 32)
    pool = random_pool(SMALL, 1)
    tx = create_sender("tcp", pool, SMALL, uid("P"), native_iov=False, secret=b"k" * 32, boot_epoch=7)
    try:
        tx.connect(rx.worker_id, rx.metadata())
        assert tx.path_kind(rx.worker_id) == "tcp"
        rx.expect(1, [3, 4], tx.worker_id, 7)
        tx.write(rx.worker_id, 1, [5, 6], [3, 4])
        tx.finish(rx.worker_id, 1, b"aux")
        assert wait_done(lambda: rx.poll(1)).state == RoomState.SUCCESS
        assert page_bytes(rx.buffer, [3, 4], rx.layout) == page_bytes(pool, [5, 6], rx.layout)
    finally:
        tx.close()
        rx.close()


def test_importing_kvtransfer_loads_neither_nixl_nor_ucxx():
    code = ("import os, sys, tandem.kvtransfer; "
            "assert not {'nixl', 'nixl_cu12', 'ucxx'} & set(sys.modules), sorted(sys.modules); "
            "assert not any(k.startswith('UCX_') for k in os.environ)")
    env = {k: v for k, v in os.environ.items() if not k.startswith("UCX_")}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, cwd=ROOT)


def test_a_receiver_that_cannot_listen_leaves_no_segment():
    worker = uid("D")
    with pytest.raises(TransferError, match="cannot listen"):
        create_receiver("auto", SMALL, "203.0.113.1", worker)    # TEST-NET-3: no address of this host
    assert not [f for f in os.listdir("/dev/shm") if f.startswith(f"{PREFIX}{worker.replace('-', '_')}-")]


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
        assert page_bytes(rx.buffer, [3, 4], rx.layout) == page_bytes(pool, [0, 1], rx.layout)
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


def test_cleanup_keeps_a_segment_whose_owner_still_holds_its_lock(tmp_path):
    # A live owner in another pid namespace: its pid looks dead here, but it holds the file's flock.
    dead = subprocess.Popen(["true"])
    dead.wait()
    held = tmp_path / f"{PREFIX}D_z-{dead.pid}-abcd"
    held.write_bytes(b"x")
    fd = os.open(held, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        assert cleanup_stale_segments(str(tmp_path)) == [] and held.exists()
    finally:
        os.close(fd)
    assert cleanup_stale_segments(str(tmp_path)) == [str(held)] and not held.exists()


def test_a_new_segment_removes_stale_ones_and_unlinks_itself_when_dropped(tmp_path):
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = tmp_path / f"{PREFIX}decode_0_1-{dead.pid}-abcd"
    stale.write_bytes(b"x")
    seg = Segment.create(SMALL, "decode-0-2", directory=str(tmp_path))
    assert not stale.exists() and os.path.exists(seg.path)
    # The live owner's file survives a cleanup (its pid is ours, and it holds the lock).
    assert cleanup_stale_segments(str(tmp_path)) == [] and os.path.exists(seg.path)
    path = seg.path
    del seg
    gc.collect()
    assert not os.path.exists(path)  # close() never ran: the segment's finalizer unlinked it


def test_a_worker_killed_with_sigkill_leaks_a_segment_the_next_worker_removes(tmp_path):
    code = ("import sys, time; from tandem.kvtransfer.protocol.shm import Segment; from tests.kvtransfer.helpers import SMALL; "
            "seg = Segment.create(SMALL, 'decode-0', directory=sys.argv[1]); print(seg.path, flush=True); "
            "time.sleep(60)")
    victim = subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        path = victim.stdout.readline().strip()
        assert path and os.path.exists(path)
        assert cleanup_stale_segments(str(tmp_path)) == []    # alive: kept
    finally:
        victim.kill()
        victim.wait()
        victim.stdout.close()
    assert os.path.exists(path)                               # SIGKILL: nothing ran
    seg = Segment.create(SMALL, "decode-0", directory=str(tmp_path))
    try:
        assert not os.path.exists(path) and os.listdir(tmp_path) == [os.path.basename(seg.path)]
    finally:
        seg.unlink()
        seg.unlink()                                          # idempotent
    assert os.listdir(tmp_path) == []


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


@pytest.mark.parametrize("layout", [SMALL, SMALL_LF], ids=["page_first", "layer_first"])
def test_unchecked_shm_copies_natively_in_pieces_and_reports_every_run(layout, monkeypatch):
    """Checksums off: shm copies with the native copy in pieces of PIECE_BYTES (here 3 pages), cutting
    runs across pieces; D accounts every page of the WROTE notes and gets the exact bytes."""
    from tandem.kvtransfer.protocol import checksum

    monkeypatch.setattr(checksum, "PIECE_BYTES", 3 * layout.num_layers * 2 * layout.page_bytes)
    rx = create_receiver("shm", layout, "127.0.0.1", uid("D"))
    pool = random_pool(layout, 7)
    tx = create_sender("shm", pool, layout, uid("P"), checksums=())
    src, dst = [9, 10, 11, 12, 13, 40, 2, 3], [20, 21, 22, 23, 24, 5, 50, 51]   # runs of 5, 1 and 2 pages
    try:
        tx.connect(rx.worker_id, rx.metadata())
        rx.expect(1, dst, tx.worker_id)
        tx.write(rx.worker_id, 1, src, dst)
        tx.finish(rx.worker_id, 1, b"aux")
        st = wait_done(lambda: rx.poll(1))
        assert st.state is RoomState.SUCCESS and st.path == "shm", st
        assert st.bytes_moved == len(dst) * layout.num_layers * 2 * layout.page_bytes
        assert page_bytes(rx.buffer, dst, layout) == page_bytes(pool, src, layout)
    finally:
        tx.close()
        rx.close()
