"""Write-behind for the disk tier: one background thread and a bounded queue, so that storing a
block never blocks the caller (a scheduler step). When the queue is full the write is dropped and
counted; the block is still in the tiers above, and a later demotion may write it."""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable
from time import perf_counter

from tandem.engine.kvcache.tiers.disk import DiskTier

log = logging.getLogger(__name__)


class WriteBehind:
    """Queue of pending disk writes, at most `max_pending`, one per key.

    Lifecycle: created idle; the thread starts with the first `submit`; `close` stops taking writes,
    lets the thread finish what is queued for up to `timeout` seconds, then abandons the rest. Safe
    to call twice.
    """

    def __init__(self, disk: DiskTier, max_pending: int = 256, *, name: str = "tandem-kv-disk-writer",
                 on_written: Callable[[float], None] | None = None):
        """`on_written(seconds)`: told, on the writer thread, how long each block it stored took."""
        if max_pending < 1:
            raise ValueError(f"max_pending must be >= 1, got {max_pending}")
        self._disk = disk
        self._on_written = on_written
        self._max = max_pending
        self._name = name
        self._cv = threading.Condition()
        self._queue: OrderedDict[bytes, tuple[bytes | None, bytes]] = OrderedDict()  # key -> (parent, payload)
        self._busy_key: bytes | None = None
        self._busy_item: tuple[bytes | None, bytes] | None = None
        self._closing = False
        self._abandon = False
        self._thread: threading.Thread | None = None
        self.submitted = 0
        self.written = 0  # stored by this writer (not: already on disk)
        self.dropped = 0  # refused because the queue was full
        self.failed = 0  # raised unexpectedly (a bug; logged)

    def submit(self, key: bytes, parent: bytes | None, payload: bytes | bytearray | memoryview) -> bool:
        """Queue a write; False when it was not queued (already pending, queue full, closed).
        A payload that is not `bytes` is copied, and only when it is queued: an L2 slot or the
        caller's buffer may be reused before the write happens."""
        with self._cv:
            if self._closing or key in self._queue or key == self._busy_key:
                return False
            if len(self._queue) >= self._max:
                self.dropped += 1
                return False
            self._queue[key] = (parent, payload if isinstance(payload, bytes) else bytes(payload))
            self.submitted += 1
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._thread.start()
            self._cv.notify()
        return True

    def pending(self, key: bytes) -> tuple[bytes | None, bytes] | None:
        """(parent, payload) of a write not yet finished, or None: a block on its way to disk is
        still loadable from here."""
        with self._cv:
            if key == self._busy_key:
                return self._busy_item
            return self._queue.get(key)

    def cancel(self, key: bytes) -> bool:
        """Drop a queued write (not one in progress); True when there was one."""
        with self._cv:
            return self._queue.pop(key, None) is not None

    @property
    def queued(self) -> int:
        with self._cv:
            return len(self._queue) + (self._busy_key is not None)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued write is done; False on timeout."""
        with self._cv:
            return self._cv.wait_for(lambda: not self._queue and self._busy_key is None, timeout)

    def close(self, timeout: float = 5.0) -> bool:
        """Stop taking writes and finish the queued ones within `timeout`; True when all were done
        and the thread has exited."""
        with self._cv:
            self._closing = True
            self._cv.notify_all()
            thread = self._thread
        if thread is None:
            return True
        thread.join(timeout)
        if thread.is_alive():
            # Abandon the rest; the thread exits after the write in progress.
            with self._cv:
                self._abandon = True
                self._queue.clear()
                self._cv.notify_all()
            thread.join(1.0)
            return False
        return True

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._queue and not self._closing:
                    self._cv.wait()
                if not self._queue or self._abandon:
                    self._queue.clear()
                    self._cv.notify_all()
                    return
                key, item = self._queue.popitem(last=False)
                self._busy_key, self._busy_item = key, item
            parent, payload = item
            stored = False
            try:
                t0 = perf_counter()
                stored = self._disk.put(key, parent, payload)
                if stored and self._on_written is not None:
                    self._on_written(perf_counter() - t0)
            except Exception:
                log.exception("KV disk writer: writing block %s failed", key.hex())
                with self._cv:
                    self.failed += 1
            with self._cv:
                self.written += stored
                self._busy_key = self._busy_item = None
                self._cv.notify_all()
