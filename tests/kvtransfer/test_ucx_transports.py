"""RDMA preflight of the ucx backend: UCX is asked which transports an endpoint's lanes really use."""

import pytest

from tandem.kvtransfer import create_receiver, create_sender
from tandem.kvtransfer.backends.ucx_transports import Transport, check_rdma, is_rdma, rdma_devices
from tandem.kvtransfer.base import TransferError
from tests.kvtransfer.helpers import SMALL, random_pool, uid

pytestmark = pytest.mark.timeout(60)


def test_rdma_classification_and_check():
    assert is_rdma("rc_mlx5") and is_rdma("dc_mlx5") and is_rdma("ud_verbs") and is_rdma("srd")
    assert not is_rdma("tcp") and not is_rdma("cma") and not is_rdma("posix") and not is_rdma("sysv")
    check_rdma([Transport("rc_mlx5", "mlx5_0:1")], "d")
    with pytest.raises(TransferError, match="tcp/eth0"):
        check_rdma([Transport("rc_mlx5", "mlx5_0:1"), Transport("tcp", "eth0")], "d")
    with pytest.raises(TransferError, match="no transport"):
        check_rdma([], "d")


def test_rdma_devices_reads_sysfs(tmp_path):
    assert rdma_devices(str(tmp_path / "missing")) == []
    (tmp_path / "mlx5_1").mkdir()
    (tmp_path / "mlx5_0").mkdir()
    assert rdma_devices(str(tmp_path)) == ["mlx5_0", "mlx5_1"]


def test_ucx_sender_reports_the_negotiated_transport_and_require_rdma_refuses_tcp():
    rx = create_receiver("ucx", SMALL, "127.0.0.1", uid("D"))
    pool = random_pool(SMALL, 3)
    tx = create_sender("ucx", pool, SMALL, uid("P"))
    strict = create_sender("ucx", pool, SMALL, uid("P2"), require_rdma=True)
    try:
        tx.connect(rx.worker_id, rx.metadata())
        transports = tx.transports(rx.worker_id)
        # On one host without RDMA devices UCX picks tcp on lo and/or shared memory (cma, posix, sysv).
        assert transports, "ucp_ep_query reported no lanes"
        assert all(t.name for t in transports) and any(t.device for t in transports)
        assert {t.name for t in transports} <= {"tcp", "cma", "posix", "sysv", "xpmem", "knem", "self"}
        assert not any(t.rdma for t in transports)
        with pytest.raises(TransferError, match="--require-rdma: UCX reached .* not RDMA"):
            strict.connect(rx.worker_id, rx.metadata())
        assert not strict.has_peer(rx.worker_id) and strict.transports(rx.worker_id) == []
    finally:
        strict.close()
        tx.close()
        rx.close()
