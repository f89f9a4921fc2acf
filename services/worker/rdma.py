"""`--require-rdma`: fail at start, not at the first slow transfer, when RDMA is not what UCX will use.

At start (`preflight`): the backend must be one that can use RDMA (nixl, ucx) and the host must expose
an RDMA device (/sys/class/infiniband: InfiniBand, RoCE and EFA all appear there); otherwise the worker
exits with a message instead of serving over tcp. Per peer (`transfer_options`): the ucx sender checks
the transports UCX negotiated for each endpoint and refuses non-RDMA lanes; nixl (whose endpoints are
not visible from Python) gets UCX_TLS restricted to RDMA transports, so UCX fails the connection rather
than fall back to tcp. Either way the decode worker's Bootstrap is refused with a message naming why.
"""

from __future__ import annotations

import logging
import os

from tandem.kvtransfer.backends.ucx_transports import RDMA_TLS, rdma_devices
from tandem.services.worker.config import WorkerConfig

log = logging.getLogger(__name__)

RDMA_BACKENDS = ("nixl", "ucx")


def preflight(wcfg: WorkerConfig, sysfs: str = "/sys/class/infiniband") -> None:
    """Raise SystemExit when `--require-rdma` cannot be met on this host."""
    if not wcfg.require_rdma:
        return
    if wcfg.transfer_backend not in RDMA_BACKENDS:
        raise SystemExit(f"--require-rdma needs --transfer-backend nixl or ucx, not {wcfg.transfer_backend!r}")
    devices = rdma_devices(sysfs)
    if not devices:
        raise SystemExit(f"--require-rdma: no RDMA device in {sysfs} (is the RDMA device plugin's resource "
                         "requested and the pod's /sys/class/infiniband populated?)")
    log.info("RDMA preflight: devices %s", ", ".join(devices))


def transfer_options(wcfg: WorkerConfig, side: str) -> dict:
    """Extra options for create_sender (`side="sender"`) / create_receiver (`"receiver"`): the
    handshake secret, and the RDMA requirements."""
    options: dict = {"secret": wcfg.auth.transfer_key}
    if side == "sender":
        options["boot_epoch"] = wcfg.boot_epoch     # receivers bind each room to this instance
    if not wcfg.require_rdma:
        return options
    if wcfg.transfer_backend == "ucx":
        return {**options, "require_rdma": True} if side == "sender" else options
    from tandem.kvtransfer.backends.ucx_env import UcxSettings

    # The user's UCX_TLS wins when it is set (they know their fabric); otherwise RDMA or nothing.
    tls = "" if os.environ.get("UCX_TLS") else RDMA_TLS
    return {**options, "ucx": UcxSettings.from_env(tls=tls)}
