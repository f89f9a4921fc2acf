"""Per-worker circuit breakers: stop sending to a worker that keeps failing, try it again later.

A worker instance (worker_id and boot epoch: a restarted worker starts with a clean record) is
*closed* (used) until `failure_threshold` requests in a row fail on it with UNAVAILABLE; then it is
*open* (skipped) for `cooldown_s`, after which it is *half-open*: it gets requests again, one success
closes it, one failure opens it again for twice as long (up to `max_cooldown_s`).

When every worker of a role is open the router uses them all anyway (Envoy's "panic" rule): a
breaker exists to prefer healthy workers, never to turn a partial outage into a total one.
Torch-free; the router's event loop is its only user.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from tandem.v1 import worker_pb2

log = logging.getLogger(__name__)

Key = tuple[str, int]   # (worker_id, boot_epoch)


def key_of(w: worker_pb2.WorkerInfo) -> Key:
    return (w.worker_id, w.boot_epoch)


@dataclass
class _Circuit:
    failures: int = 0              # consecutive
    open_until: float = 0.0        # > 0: opened at least once (open, or half-open once it passed)
    cooldown_s: float = 0.0


class Breakers:
    def __init__(self, failure_threshold: int = 3, cooldown_s: float = 5.0, max_cooldown_s: float = 60.0,
                 clock: Callable[[], float] = time.monotonic):
        assert failure_threshold >= 1 and cooldown_s > 0
        self.failure_threshold = failure_threshold
        self.cooldown_s = cooldown_s
        self.max_cooldown_s = max_cooldown_s
        self.clock = clock
        self._circuits: dict[Key, _Circuit] = {}

    def is_open(self, w: worker_pb2.WorkerInfo) -> bool:
        c = self._circuits.get(key_of(w))
        return c is not None and self.clock() < c.open_until

    def healthy(self, workers: Sequence[worker_pb2.WorkerInfo]) -> list[worker_pb2.WorkerInfo]:
        """The workers whose circuit is not open; all of them when every one is open."""
        closed = [w for w in workers if not self.is_open(w)]
        return closed or list(workers)

    def open_count(self) -> int:
        now = self.clock()
        return sum(1 for c in self._circuits.values() if now < c.open_until)

    def on_success(self, w: worker_pb2.WorkerInfo) -> None:
        c = self._circuits.pop(key_of(w), None)
        if c is not None and c.open_until:
            log.info("circuit of %s closed again", w.worker_id)

    def on_failure(self, w: worker_pb2.WorkerInfo, why: str) -> None:
        c = self._circuits.setdefault(key_of(w), _Circuit())
        c.failures += 1
        now = self.clock()
        half_open = c.open_until and now >= c.open_until
        if c.failures >= self.failure_threshold or half_open:
            c.cooldown_s = min(self.max_cooldown_s, c.cooldown_s * 2) if half_open else self.cooldown_s
            c.open_until = now + c.cooldown_s
            c.failures = 0
            log.warning("circuit of %s opened for %.1fs: %s", w.worker_id, c.cooldown_s, why)

    def retain(self, workers: Iterable[worker_pb2.WorkerInfo]) -> None:
        """Forget instances that left the registry (a restarted worker has a new epoch)."""
        live = {key_of(w) for w in workers}
        for k in [k for k in self._circuits if k not in live]:
            del self._circuits[k]
