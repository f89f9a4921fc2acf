"""`--fault-inject transfer_fail=P,transfer_delay_ms=MS,kv_corrupt=P` on a prefill worker: a KVSender
wrapper for the first two, and the sender's own in-flight corruption hook for the third.

Kept apart from services/worker/faults.py (torch-free, read by the command line) because every
transfer backend's interface brings torch with it.
"""

from __future__ import annotations

import logging
import random
import threading
from collections.abc import Callable

from tandem.kvtransfer.base import KVSender, Progress, RoomState, RoomStatus
from tandem.services.worker.faults import FaultConfig

log = logging.getLogger(__name__)


class FaultySender(KVSender):
    """Wraps a prefill worker's KVSender: fails a drawn share of rooms, delays their completion.

    A room drawn to fail is aborted (the real abort: D is told, and no write of the room lands after it
    returns) right after its first write, so the failure travels the same path as a real one."""

    def __init__(self, inner: KVSender, cfg: FaultConfig, worker_id: str = ""):
        self.inner = inner
        self.name = inner.name
        self.cfg = cfg
        # With a seed, each worker draws its own reproducible sequence (the same seed on every worker
        # must not make their failures coincide, or a retry on another worker would fail in step).
        self._rng = random.Random(None if cfg.seed is None else f"{cfg.seed}/{worker_id}")
        self._lock = threading.Lock()
        self._fated: dict[int, bool] = {}                 # room -> drawn to fail
        self._timers: dict[int, threading.Timer] = {}     # delayed finish() per room

    def _fails(self, room: int) -> bool:
        with self._lock:
            if room not in self._fated:
                self._fated[room] = self._rng.random() < self.cfg.transfer_fail
            return self._fated[room]

    def connect(self, peer_id: str, metadata: bytes) -> None:
        self.inner.connect(peer_id, metadata)

    def has_peer(self, peer_id: str) -> bool:
        return self.inner.has_peer(peer_id)

    def transports(self, peer_id: str) -> list:
        return self.inner.transports(peer_id)

    def writes_layers(self, peer_id: str) -> bool:
        return self.inner.writes_layers(peer_id)

    def write(self, peer_id: str, room: int, src_pages: list[int], dst_pages: list[int],
              layers: tuple[int, int] | None = None) -> None:
        self.inner.write(peer_id, room, src_pages, dst_pages, layers)
        if self._fails(room) and not self.inner.status(room).state.done:
            log.warning("fault injection: failing the KV transfer of room %d", room)
            self.inner.abort(room)

    def finish(self, peer_id: str, room: int, aux: bytes) -> None:
        if self._fails(room):
            self.inner.finish(peer_id, room, aux)          # a no-op on the failed room; keeps its bookkeeping
            return
        delay = self.cfg.transfer_delay_ms / 1e3
        if delay <= 0:
            self.inner.finish(peer_id, room, aux)
            return
        timer = threading.Timer(delay, self._finish_late, (peer_id, room, aux))
        timer.daemon = True
        with self._lock:
            self._timers[room] = timer
        timer.start()

    def progress(self, peer_id: str, room: int, progress: Progress) -> None:
        self.inner.progress(peer_id, room, progress)

    def _finish_late(self, peer_id: str, room: int, aux: bytes) -> None:
        with self._lock:
            if self._timers.pop(room, None) is None:
                return                                       # aborted or released meanwhile
        try:
            self.inner.finish(peer_id, room, aux)
        except Exception as e:                               # the room failed meanwhile: its status says so
            log.info("fault injection: delayed finish of room %d: %s", room, e)

    def status(self, room: int) -> RoomStatus:
        status = self.inner.status(room)
        with self._lock:
            fated = self._fated.get(room, False)
        if fated and status.state is RoomState.FAILED:
            status.error = f"injected transfer failure (--fault-inject transfer_fail={self.cfg.transfer_fail:g})"
        return status

    def _forget(self, room: int) -> None:
        with self._lock:
            self._fated.pop(room, None)
            timer = self._timers.pop(room, None)
        if timer is not None:
            timer.cancel()

    def abort(self, room: int) -> None:
        self._forget(room)
        self.inner.abort(room)

    def release(self, room: int) -> None:
        self._forget(room)
        self.inner.release(room)

    def close(self) -> None:
        with self._lock:
            timers, self._timers = list(self._timers.values()), {}
        for t in timers:
            t.cancel()
        self.inner.close()


def wrap_sender(sender: KVSender, cfg: FaultConfig, worker_id: str = "") -> KVSender:
    """The sender itself unless transfer faults are configured."""
    return FaultySender(sender, cfg, worker_id) if cfg.transfers else sender


def sender_options(cfg: FaultConfig, worker_id: str = "") -> dict:
    """create_sender options for `kv_corrupt`: the draw of the rooms whose KV is corrupted on its way
    (the protocol's Sender flips a byte after the checksum; kvtransfer/protocol/sender.py). {} if off."""
    if cfg.kv_corrupt <= 0:
        return {}
    rng = random.Random(None if cfg.seed is None else f"{cfg.seed}/{worker_id}/kv")
    return {"corrupt": _corrupt_draw(cfg.kv_corrupt, rng)}


def _corrupt_draw(p: float, rng: random.Random) -> Callable[[int], bool]:
    lock = threading.Lock()

    def corrupt(room: int) -> bool:
        with lock:
            hit = rng.random() < p
        if hit:
            log.warning("fault injection: corrupting the KV of room %d on its way (--fault-inject kv_corrupt=%g)",
                        room, p)
        return hit

    return corrupt
