"""Which transports UCX actually uses: per-endpoint lanes (`ucp_ep_query`) and the host's RDMA devices.

The ucx backend asks UCX, once an endpoint to a peer is wired up, which (transport, device) pairs its
lanes use, so a worker can log and export them and `--require-rdma` can refuse a peer that UCX reached
over tcp (or shared memory) instead of silently running slowly. ucxx exposes the endpoint's raw
`ucp_ep_h` (`UCXEndpoint.handle`) but not `ucp_ep_query`, so it is called through ctypes on the very
libucp that ucxx loaded (found in /proc/self/maps).

NIXL keeps its UCX endpoints to itself: for the nixl backend `--require-rdma` restricts UCX_TLS to RDMA
transports instead (UCX then fails the connection rather than fall back), see ucx_env.py.
"""

from __future__ import annotations

import ctypes
import functools
import os
from dataclasses import dataclass

from tandem.kvtransfer.base import TransferError

# UCX transport names of RDMA (InfiniBand / RoCE verbs, mlx5 accelerated, AWS EFA's SRD).
RDMA_PREFIXES = ("rc", "dc", "ud", "srd")
RDMA_TLS = "rc,dc,ud,srd,cuda_copy,cuda_ipc"   # UCX_TLS for "RDMA or nothing" (plus GPU memory copies)
_UCP_EP_ATTR_FIELD_TRANSPORTS = 1 << 3
_UCP_ENTITY_NAME_MAX = 32
_SOCKADDR_STORAGE = 128
_MAX_LANES = 32                                  # UCP_MAX_LANES is 64 in recent UCX; 32 entries suffice


@dataclass(frozen=True)
class Transport:
    name: str                   # e.g. "rc_mlx5", "tcp", "cma", "posix"
    device: str                 # e.g. "mlx5_0:1", "eth0", "lo", "memory"

    @property
    def rdma(self) -> bool:
        return is_rdma(self.name)


def is_rdma(transport: str) -> bool:
    return transport.startswith(RDMA_PREFIXES)


class _Entry(ctypes.Structure):
    _fields_ = [("transport_name", ctypes.c_char_p), ("device_name", ctypes.c_char_p)]


class _Transports(ctypes.Structure):
    _fields_ = [("entries", ctypes.POINTER(_Entry)), ("num_entries", ctypes.c_uint),
                ("entry_size", ctypes.c_size_t)]


class _EpAttr(ctypes.Structure):   # ucp_ep_attr_t (ucp.h, UCX >= 1.14)
    _fields_ = [("field_mask", ctypes.c_uint64), ("name", ctypes.c_char * _UCP_ENTITY_NAME_MAX),
                ("local_sockaddr", ctypes.c_byte * _SOCKADDR_STORAGE),
                ("remote_sockaddr", ctypes.c_byte * _SOCKADDR_STORAGE),
                ("transports", _Transports), ("user_data", ctypes.c_void_p)]


@functools.cache
def _libucp() -> ctypes.CDLL:
    with open("/proc/self/maps") as f:
        paths = {line.split()[-1] for line in f if "libucp.so" in line}
    if not paths:
        raise TransferError("libucp is not loaded in this process (create a UCX context first)")
    lib = ctypes.CDLL(sorted(paths)[0])
    lib.ucp_ep_query.argtypes = [ctypes.c_void_p, ctypes.POINTER(_EpAttr)]
    lib.ucp_ep_query.restype = ctypes.c_int
    return lib


def endpoint_transports(ep_handle: int) -> list[Transport]:
    """The (transport, device) of each lane of a connected `ucp_ep_h`, deduplicated, in lane order."""
    entries = (_Entry * _MAX_LANES)()
    attr = _EpAttr()
    attr.field_mask = _UCP_EP_ATTR_FIELD_TRANSPORTS
    attr.transports.entries = ctypes.cast(entries, ctypes.POINTER(_Entry))
    attr.transports.num_entries = _MAX_LANES
    attr.transports.entry_size = ctypes.sizeof(_Entry)
    status = _libucp().ucp_ep_query(ctypes.c_void_p(ep_handle), ctypes.byref(attr))
    if status != 0:
        raise TransferError(f"ucp_ep_query failed (ucs_status {status})")
    out: list[Transport] = []
    for i in range(min(attr.transports.num_entries, _MAX_LANES)):
        e = entries[i]
        t = Transport((e.transport_name or b"").decode(), (e.device_name or b"").decode())
        if t.name and t not in out:
            out.append(t)
    return out


def rdma_devices(sysfs: str = "/sys/class/infiniband") -> list[str]:
    """RDMA devices the kernel exposes on this host (InfiniBand, RoCE, EFA all appear here)."""
    try:
        return sorted(os.listdir(sysfs))
    except OSError:
        return []


def check_rdma(transports: list[Transport], peer: str) -> None:
    """`--require-rdma`: every data lane must be RDMA; raise TransferError naming what UCX chose."""
    slow = [t for t in transports if not t.rdma]
    if not transports or slow:
        chosen = ", ".join(f"{t.name}/{t.device}" for t in transports) or "no transport"
        raise TransferError(f"--require-rdma: UCX reached {peer} over {chosen}, not RDMA "
                            f"(check the RDMA device resource, UCX_NET_DEVICES and UCX_TLS)")
