"""KV events, the worker's transport: the engine's EventLink outbox → a Redis stream per worker.

Why Redis streams (docs/kv-cache.md, KV events): the registry's Redis is already there wherever
the router can use events; a stream is ordered, keeps recent messages for a reader that is a moment
late, is read by any number of routers without the worker knowing them, and needs no extra server or
port. Entries are trimmed (`XADD MAXLEN ~`) and the stream expires when the worker stops writing.
A router asks for a snapshot by pushing onto the worker's request list, which this thread polls.

One daemon thread: it takes messages from the outbox (bounded, filled on the engine thread), writes
up to `max_messages` of them in one pipeline, and polls the request list every `request_poll_s`. The
engine thread never waits for it. A Redis error loses the messages in hand: the thread logs the
outage once and has the next message be a snapshot, so routers are exact again once Redis is back.
"""

from __future__ import annotations

import json
import logging
import threading
import time

from tandem.engine.kvcache.tiers.event_link import EventLink
from tandem.kvblocks.events import KVEventBatch, KVMessage
from tandem.kvblocks.keys import Namespace
from tandem.services.worker import metrics
from tandem.v1 import worker_pb2

log = logging.getLogger(__name__)

REGISTRY_PREFIX = "tandem"  # the Redis registry's key prefix, which workers announce under
STREAM_MAXLEN = 1000        # entries kept per worker (~ trimming); routers read within milliseconds
STREAM_TTL_S = 3600         # a stream nobody writes to any more (the worker is gone) disappears
REQUESTS_TTL_S = 60


def stream_key(prefix: str, worker_id: str) -> str:
    return f"{prefix}:kv:{worker_id}"


def event_source(prefix: str, worker_id: str, ns: Namespace) -> worker_pb2.KVEventSource:
    """What the worker announces in its WorkerInfo: where its events are, and its key space."""
    stream = stream_key(prefix, worker_id)
    return worker_pb2.KVEventSource(
        stream=stream, snapshot_requests=f"{stream}:snapshot",
        namespace=worker_pb2.KVBlockNamespace(model=ns.model, dtype=ns.dtype, page_size=ns.page_size,
                                              num_layers=ns.num_layers, kv_heads=ns.kv_heads, head_dim=ns.head_dim))


class KVEventSender:
    """Lifecycle: create → `start()` → `close()` (writes what is queued, within `timeout`; safe twice)."""

    def __init__(self, link: EventLink, url: str, source: worker_pb2.KVEventSource, *, max_messages: int = 32,
                 poll_s: float = 0.05, request_poll_s: float = 0.1):
        self.link = link
        self.url = url
        self.source = source
        self.max_messages = max_messages
        self.poll_s = poll_s
        self.request_poll_s = request_poll_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._client = None
        self._down = False
        self.sent = self.lost = 0   # messages written / lost to Redis errors

    def start(self) -> None:
        import redis  # imported here: no client library work at module import

        self._client = redis.Redis.from_url(self.url, socket_timeout=2.0, socket_connect_timeout=2.0)
        self._thread.start()

    def close(self, timeout: float = 2.0) -> None:
        if self._stop.is_set():
            return
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout)
        if self._client is not None:
            self._client.close()

    def _run(self) -> None:
        next_poll = 0.0
        while True:
            stopping = self._stop.is_set()
            msgs = self.link.take(self.max_messages, 0.0 if stopping else self.poll_s)
            if msgs:
                self._write(msgs)
            if stopping and not msgs:
                return
            now = time.monotonic()
            if now >= next_poll and not stopping:
                next_poll = now + self.request_poll_s
                self._poll_requests()

    def _write(self, msgs: list[KVMessage]) -> None:
        stream = self.source.stream
        try:
            pipe = self._client.pipeline(transaction=False)
            for m in msgs:
                pipe.xadd(stream, {"m": json.dumps(m.to_dict(), separators=(",", ":"))},
                          maxlen=STREAM_MAXLEN, approximate=True)
            pipe.expire(stream, STREAM_TTL_S)
            pipe.execute()
        except Exception as e:
            self._failed(e)
            self.lost += len(msgs)
            metrics.KV_EVENT_MESSAGES_LOST.inc(len(msgs))
            return
        self._ok()
        self.sent += len(msgs)
        for m in msgs:
            if isinstance(m, KVEventBatch):
                metrics.KV_EVENT_MESSAGES.labels("batch").inc()
                metrics.KV_EVENTS_PUBLISHED.inc(len(m.events))
            else:
                metrics.KV_EVENT_MESSAGES.labels("snapshot").inc()

    def _poll_requests(self) -> None:
        key = self.source.snapshot_requests
        try:
            pipe = self._client.pipeline(transaction=True)
            pipe.llen(key)
            pipe.delete(key)
            asked, _ = pipe.execute()
        except Exception as e:
            self._failed(e)
            return
        self._ok()
        if asked:
            self.link.want_snapshot()

    def _failed(self, e: BaseException) -> None:
        self.link.want_snapshot()   # whatever is lost, the next message is the whole state
        if not self._down:
            log.warning("KV events to %s failed (will retry; the next message is a snapshot): %s", self.url, e)
        self._down = True

    def _ok(self) -> None:
        if self._down:
            log.info("KV events to %s recovered", self.url)
        self._down = False
