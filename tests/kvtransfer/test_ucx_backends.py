"""What is particular to the UCX-based backends (nixl, ucx): settings, the message plan, liveness,
error-handling agreement. Their transfers are covered by test_conformance.py with every backend."""

import os
import socket

import numpy as np
import pytest

from tandem.kvtransfer import create_receiver, create_sender
from tandem.kvtransfer.backends.ucx import DIRECT_MIN, STAGE_BYTES, plan_messages
from tandem.kvtransfer.backends.ucx_env import UcxSettings
from tandem.kvtransfer.base import RoomState, TransferError
from tandem.kvtransfer.protocol.liveness import connection_up
from tests.kvtransfer.helpers import SMALL, page_bytes, random_pool, uid, wait_done, wait_until

pytestmark = pytest.mark.timeout(60)


def test_settings_precedence_flags_over_env_over_defaults():
    assert UcxSettings.from_env({}) == UcxSettings(tls="", net_devices="", error_handling="peer")
    env = {"UCX_TLS": "tcp,cma", "UCX_NET_DEVICES": "eth0", "TANDEM_UCX_ERROR_HANDLING": "None"}
    assert UcxSettings.from_env(env) == UcxSettings("tcp,cma", "eth0", "none")
    flags = UcxSettings.from_env(env, tls="posix,self", net_devices="", error_handling="none")
    assert flags == UcxSettings("posix,self", "eth0", "none")          # empty flags do not override
    with pytest.raises(ValueError, match="peer"):
        UcxSettings.from_env({"TANDEM_UCX_ERROR_HANDLING": "sometimes"})


def test_loopback_receivers_keep_ucx_on_lo():
    s = UcxSettings()
    assert s.devices_for("127.0.0.1") == "lo" and s.devices_for("localhost") == "lo"
    assert s.devices_for("10.0.0.5") == "" and s.devices_for(None) == ""       # a sender: all devices
    assert UcxSettings(net_devices="mlx5_0:1").devices_for("127.0.0.1") == "mlx5_0:1"
    assert UcxSettings(tls="tcp").ucx_config("127.0.0.1") == {"TLS": "tcp", "NET_DEVICES": "lo"}
    assert UcxSettings().ucx_config(None) == {}                        # never an empty UCX_TLS


def test_process_env_restores_ucx_tls(monkeypatch):
    monkeypatch.setenv("UCX_TLS", "tcp")
    with UcxSettings(tls="posix,self").process_env():
        assert os.environ["UCX_TLS"] == "posix,self"
    assert os.environ["UCX_TLS"] == "tcp"
    monkeypatch.delenv("UCX_TLS")
    with UcxSettings(tls="tcp,self").process_env():
        assert os.environ["UCX_TLS"] == "tcp,self"
    assert "UCX_TLS" not in os.environ


def test_message_plan_sends_long_runs_directly_and_packs_short_ones():
    pb, regions = 6144, 60
    long_run = -(-DIRECT_MIN // pb)                           # pages: its per-region piece is direct
    lengths = np.array([1, 2, long_run, 1] + [1] * 40)
    msgs = plan_messages(lengths, pb, regions)
    assert sum(m.nbytes for m in msgs) == int(lengths.sum()) * pb * regions
    assert msgs[0].staged and (msgs[0].run, msgs[0].end) == (0, 2)          # flushed before the long run
    direct = msgs[1:1 + regions]
    assert [(m.run, m.region, m.staged) for m in direct] == [(2, r, False) for r in range(regions)]
    rest = msgs[1 + regions:]
    assert all(m.staged and m.nbytes <= STAGE_BYTES for m in rest)
    assert [(m.run, m.end) for m in rest][0][0] == 3 and rest[-1].end == len(lengths)
    covered = [j for m in msgs if m.staged for j in range(m.run, m.end)]
    assert covered == [j for j in range(len(lengths)) if j != 2]           # every short run exactly once
    assert plan_messages(np.array([], dtype=np.int64), pb, regions) == []


def test_connection_up_sees_a_closed_or_shut_down_peer():
    server = socket.create_server(("127.0.0.1", 0))
    a = socket.create_connection(server.getsockname())
    b, _ = server.accept()
    c = socket.create_connection(server.getsockname())
    d, _ = server.accept()
    try:
        assert connection_up(a) and connection_up(b)
        b.sendall(b"unread frame")
        b.close()                                              # the peer is gone; its data is still queued
        assert wait_until(lambda: not connection_up(a), 5.0)
        c.shutdown(socket.SHUT_RDWR)                           # this side gave up on the connection
        assert not connection_up(c)
        c.close()
        assert not connection_up(c)
    finally:
        for s in (a, c, d, server):
            s.close()


def test_ucx_sender_follows_the_receivers_error_handling():
    """A receiver that gives up peer-failure detection (e.g. for shared-memory-only UCX_TLS): the sender's
    endpoint must use the same mode, whatever its own settings say."""
    before = {k for k in os.environ if k.startswith("UCX_")}
    rx = create_receiver("ucx", SMALL, "127.0.0.1", uid("D"), ucx=UcxSettings(error_handling="none"))
    pool = random_pool(SMALL, 7)
    tx = create_sender("ucx", pool, SMALL, uid("P"), ucx=UcxSettings(error_handling="peer"))
    try:
        assert {k for k in os.environ if k.startswith("UCX_")} == before      # ucxx's import defaults stay out
        tx.connect(rx.worker_id, rx.metadata())
        rx.expect(3, [10, 11, 40], tx.worker_id)
        tx.write(rx.worker_id, 3, [1, 2, 9], [10, 11, 40])
        tx.finish(rx.worker_id, 3, b"ok")
        assert wait_done(lambda: tx.status(3)).state == RoomState.SUCCESS
        assert page_bytes(rx.buffer, [10, 11, 40], rx.layout) == page_bytes(pool, [1, 2, 9], rx.layout)
    finally:
        tx.close()
        rx.close()


def test_nixl_refuses_a_peer_with_other_error_handling():
    rx = create_receiver("nixl", SMALL, "127.0.0.1", uid("D"), ucx=UcxSettings(error_handling="none"))
    tx = create_sender("nixl", random_pool(SMALL, 0), SMALL, uid("P"))
    try:
        with pytest.raises(TransferError, match="error handling differs"):
            tx.connect(rx.worker_id, rx.metadata())
        assert not tx.has_peer(rx.worker_id)
    finally:
        tx.close()
        rx.close()


@pytest.mark.parametrize("backend", ["nixl", "ucx"])
def test_metadata_without_the_backend_entry_is_refused(backend):
    tcp_rx = create_receiver("tcp", SMALL, "127.0.0.1", uid("D"))
    tx = create_sender(backend, random_pool(SMALL, 0), SMALL, uid("P"))
    try:
        with pytest.raises(TransferError):
            tx.connect(tcp_rx.worker_id, tcp_rx.metadata())
    finally:
        tx.close()
        tcp_rx.close()
