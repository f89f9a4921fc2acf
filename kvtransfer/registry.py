"""Backend registry: `create_receiver` / `create_sender` by name.

| name   | receiver (D)                                   | sender (P)                                      |
|--------|------------------------------------------------|-------------------------------------------------|
| `tcp`  | pool in private memory, pages over TCP         | pages over TCP                                  |
| `shm`  | pool in /dev/shm, control over TCP             | copies into D's mapped pool (same host only)    |
| `auto` | pool in /dev/shm, accepts shm and tcp writers  | shm when D is on this host and its segment opens, else tcp |
| `nixl` | pool registered with a NIXL agent (UCX)        | NIXL WRITEs of merged page runs (RDMA, cma, tcp) |
| `ucx`  | pool reached through a ucxx listener endpoint  | page runs as UCX tagged messages (ucxx)          |

`nixl` and `ucx` load their libraries only when such a backend is created. `auto` does not pick them
(see docs/benchmarks.md): on one host shm is faster, and between CPU hosts without RDMA so is tcp.
"""

from __future__ import annotations

import functools

import torch

from kvtransfer.base import RECEIVERS, SENDERS, KVReceiver, KVSender, PoolLayout
from kvtransfer.protocol.receiver import Receiver
from kvtransfer.protocol.sender import Sender

_BACKENDS = {           # name -> (data paths a receiver accepts, data paths a sender tries, in order)
    "tcp": (("tcp",), ("tcp",)),
    "shm": (("shm",), ("shm",)),
    "auto": (("shm", "tcp"), ("shm", "tcp")),
}

for _name, (_accepts, _tries) in _BACKENDS.items():
    RECEIVERS[_name] = functools.partial(Receiver, name=_name, backends=_accepts)
    SENDERS[_name] = functools.partial(Sender, name=_name, paths=_tries)


def _nixl_receiver(*args, **options) -> KVReceiver:
    from kvtransfer.backends.nixl import NixlReceiver
    return NixlReceiver(*args, **options)


def _nixl_sender(*args, **options) -> KVSender:
    from kvtransfer.backends.nixl import NixlSender
    return NixlSender(*args, **options)


def _ucx_receiver(*args, **options) -> KVReceiver:
    from kvtransfer.backends.ucx import UcxReceiver
    return UcxReceiver(*args, **options)


def _ucx_sender(*args, **options) -> KVSender:
    from kvtransfer.backends.ucx import UcxSender
    return UcxSender(*args, **options)


RECEIVERS.update(nixl=_nixl_receiver, ucx=_ucx_receiver)
SENDERS.update(nixl=_nixl_sender, ucx=_ucx_sender)


def create_receiver(name: str, layout: PoolLayout, host: str, worker_id: str, **options) -> KVReceiver:
    """D's receiver. `options` go to the backend (e.g. `timeouts=wire.Timeouts(...)`)."""
    if name not in RECEIVERS:
        raise ValueError(f"unknown kv transfer backend {name!r}; known: {', '.join(sorted(RECEIVERS))}")
    return RECEIVERS[name](layout, host, worker_id, **options)


def create_sender(name: str, buffer: torch.Tensor, layout: PoolLayout, worker_id: str, **options) -> KVSender:
    """P's sender over its pool `buffer` (shape `layout.shape`)."""
    if name not in SENDERS:
        raise ValueError(f"unknown kv transfer backend {name!r}; known: {', '.join(sorted(SENDERS))}")
    return SENDERS[name](buffer, layout, worker_id, **options)
