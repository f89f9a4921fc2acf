"""Backend registry: `create_receiver` / `create_sender` by name.

| name   | receiver (D)                                   | sender (P)                                      |
|--------|------------------------------------------------|-------------------------------------------------|
| `tcp`  | pool in private memory, pages over TCP         | pages over TCP                                  |
| `shm`  | pool in /dev/shm, control over TCP             | copies into D's mapped pool (same host only)    |
| `auto` | pool in /dev/shm, accepts shm and tcp writers  | shm when D is on this host and its segment opens, else tcp |
| `nixl` | pool registered with a NIXL agent (UCX)        | NIXL WRITEs of merged page runs (RDMA, cma, tcp) |
| `ucx`  | pool reached through a ucxx listener endpoint  | page runs as UCX tagged messages (ucxx)          |

A backend is a list of data paths on each side (kvtransfer/datapath.py); the protocol's `Receiver`
and `Sender` (kvtransfer/protocol/) are the same for all of them. `nixl` and `ucx` load their
libraries only when such a backend is created. `auto` does not pick them (see docs/benchmarks.md): on
one host shm is faster, and between CPU hosts without RDMA so is tcp.

Options (`create_receiver(..., **options)`) go to every part whose constructor names them: the
protocol's side (`timeouts`, `secret`; the sender's `boot_epoch`, `checksums` and the test-only
`corrupt`) and the data paths (`native_iov`:
tcp; `ucx`: nixl and ucx; `require_rdma`: the ucx sender; `timeouts` also to the paths that wait on
their own connection). An option that no part takes is a TypeError.
"""

from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass

import torch

from tandem.kvtransfer.base import KVReceiver, KVSender, PoolLayout
from tandem.kvtransfer.datapath import ReceiverPath, SenderPath
from tandem.kvtransfer.protocol.receiver import Receiver
from tandem.kvtransfer.protocol.sender import Sender

# Data path -> its ReceiverPath and SenderPath as "module:class", imported when a backend uses it.
DATA_PATHS: dict[str, tuple[str, str]] = {
    "shm": ("tandem.kvtransfer.protocol.shm:ShmReceiverPath", "tandem.kvtransfer.protocol.shm:ShmSenderPath"),
    "tcp": ("tandem.kvtransfer.protocol.tcp:TcpReceiverPath", "tandem.kvtransfer.protocol.tcp:TcpSenderPath"),
    "nixl": ("tandem.kvtransfer.backends.nixl:NixlReceiverPath", "tandem.kvtransfer.backends.nixl:NixlSenderPath"),
    "ucx": ("tandem.kvtransfer.backends.ucx:UcxReceiverPath", "tandem.kvtransfer.backends.ucx:UcxSenderPath"),
}


@dataclass(frozen=True)
class Backend:
    accepts: tuple[str, ...]         # data paths a receiver offers, in its order of preference
    tries: tuple[str, ...]           # data paths a sender tries for each peer, in order


BACKENDS: dict[str, Backend] = {
    "tcp": Backend(("tcp",), ("tcp",)),
    "shm": Backend(("shm",), ("shm",)),
    "auto": Backend(("shm", "tcp"), ("shm", "tcp")),
    "nixl": Backend(("nixl",), ("nixl",)),
    "ucx": Backend(("ucx",), ("ucx",)),
}


def _backend(name: str) -> Backend:
    if name not in BACKENDS:
        raise ValueError(f"unknown kv transfer backend {name!r}; known: {', '.join(sorted(BACKENDS))}")
    return BACKENDS[name]


def _load(target: str) -> type:
    module, _, cls = target.partition(":")
    return getattr(importlib.import_module(module), cls)


def _split(name: str, options: dict, parts: list[type]) -> list[dict]:
    """Each part's options: the keyword-only parameters its constructor names (bar the two the registry
    fills in itself). TypeError for an option that no part names."""
    named = [{n for n, p in inspect.signature(part).parameters.items() if p.kind is p.KEYWORD_ONLY} - {"name", "paths"}
             for part in parts]
    unknown = set(options).difference(*named)
    if unknown:
        raise TypeError(f"kv transfer backend {name!r} takes no option {', '.join(sorted(unknown))}")
    return [{k: v for k, v in options.items() if k in params} for params in named]


def create_receiver(name: str, layout: PoolLayout, host: str, worker_id: str, **options) -> KVReceiver:
    """D's receiver. `options` go to the parts that take them (e.g. `timeouts=wire.Timeouts(...)`)."""
    classes: list[type[ReceiverPath]] = [_load(DATA_PATHS[kind][0]) for kind in _backend(name).accepts]
    own, *each = _split(name, options, [Receiver, *classes])
    paths = [cls(layout, host, worker_id, **opts) for cls, opts in zip(classes, each, strict=True)]
    return Receiver(layout, host, worker_id, name=name, paths=paths, **own)


def create_sender(name: str, buffer: torch.Tensor, layout: PoolLayout, worker_id: str, **options) -> KVSender:
    """P's sender over its pool `buffer` (shape `layout.shape`)."""
    classes: list[type[SenderPath]] = [_load(DATA_PATHS[kind][1]) for kind in _backend(name).tries]
    own, *each = _split(name, options, [Sender, *classes])
    paths = [cls(layout, worker_id, **opts) for cls, opts in zip(classes, each, strict=True)]
    return Sender(buffer, layout, worker_id, name=name, paths=paths, **own)
