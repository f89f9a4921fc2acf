"""Backend registry: `create_receiver` / `create_sender` by name.

| name   | receiver (D)                                   | sender (P)                                      |
|--------|------------------------------------------------|-------------------------------------------------|
| `tcp`  | pool in private memory, pages over TCP         | pages over TCP                                  |
| `shm`  | pool in /dev/shm, control over TCP             | copies into D's mapped pool (same host only)    |
| `auto` | pool in /dev/shm, accepts shm and tcp writers  | shm when D is on this host and its segment opens, else tcp |
"""

from __future__ import annotations

import functools

import torch

from kvtransfer.base import RECEIVERS, SENDERS, KVReceiver, KVSender, PoolLayout
from kvtransfer.receiver import Receiver
from kvtransfer.sender import Sender

_BACKENDS = {           # name -> (data paths a receiver accepts, data paths a sender tries, in order)
    "tcp": (("tcp",), ("tcp",)),
    "shm": (("shm",), ("shm",)),
    "auto": (("shm", "tcp"), ("shm", "tcp")),
}

for _name, (_accepts, _tries) in _BACKENDS.items():
    RECEIVERS[_name] = functools.partial(Receiver, name=_name, backends=_accepts)
    SENDERS[_name] = functools.partial(Sender, name=_name, paths=_tries)


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
