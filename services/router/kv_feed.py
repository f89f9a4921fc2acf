"""KV events, the router's wiring: the workers' Redis streams into a `KVEventIndex`, snapshot
requests back, and the exact view the planner asks before its approximate one.

A worker that publishes events says where in its WorkerInfo (`kv_events`: its stream, its snapshot
request list, its block-key namespace). `KVEventFeed` follows the streams of the workers the registry
lists: one task, one XREAD over all of them. A worker it starts following (a new worker, or every
worker when the router itself just started) is read from the stream's end and asked for a snapshot
at once, so the view is exact after one round trip even if the worker is idle; a gap or a new boot
epoch asks again (KVEventIndex decides). A request is an RPUSH onto the worker's list, which the
worker's event thread polls. Only with the Redis registry: static and Kubernetes discovery have no
feed, and every worker is left to the approximate index (cache_view.py).

`EventPrefixView` answers the planner: for a worker whose view is exact and a prompt with token ids,
the prompt's cached tokens weighted by tier (`KVEventIndex.score` blocks x page size: an L1 block
counts a whole page, L2 and L3 less, see `DEFAULT_TIER_WEIGHTS`); None otherwise (fall back).
Torch-free.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Iterable, Sequence

from tandem.kvblocks.events import KVEventBatch, message_from_dict
from tandem.kvblocks.keys import Namespace
from tandem.services.router.kv_events import KVEventIndex, block_keys
from tandem.services.router.metrics import RouterMetrics
from tandem.v1 import worker_pb2

log = logging.getLogger(__name__)

REQUEST_TTL_S = 60
READ_COUNT = 256   # stream entries per XREAD


class KVEventFeed:
    """Lifecycle: create → `start()` → `sync(workers)` on every registry change → `close()` (safe twice).

    `index` is exact for a worker once its snapshot arrived and nothing was missed since."""

    def __init__(self, url: str, metrics: RouterMetrics | None = None, *, block_s: float = 0.2,
                 index: KVEventIndex | None = None):
        self.url = url
        self.metrics = metrics
        self.block_s = block_s
        self.index = index if index is not None else KVEventIndex(self.request_snapshot)
        self._client = None
        self._task: asyncio.Task | None = None
        self._sources: dict[str, worker_pb2.KVEventSource] = {}   # worker id -> where its events are
        self._last_id: dict[str, str] = {}                        # stream -> last entry read
        self._joining: set[str] = set()                           # worker ids to start following
        self._wanted: set[str] = set()                            # worker ids owed a snapshot request
        self._wake = asyncio.Event()
        self._down = False
        self._closed = False

    async def start(self) -> None:
        import redis.asyncio as aioredis  # imported here: no client library work at module import

        # The socket timeout outlasts an XREAD's BLOCK.
        self._client = aioredis.from_url(self.url, socket_timeout=self.block_s + 5.0, socket_connect_timeout=5.0)
        self._task = asyncio.create_task(self._run(), name="kv-event-feed")

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._task is not None:
            self._task.cancel()
            # asyncio.wait: the task's end is not raised here, and the caller's own cancellation is not
            # swallowed; bounded, like the client's close, so a hung connection cannot hold a shutdown.
            await asyncio.wait([self._task], timeout=2.0)
        if self._client is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._client.aclose(), 2.0)

    def sync(self, workers: Iterable[worker_pb2.WorkerInfo]) -> None:
        """Follow the event streams of `workers` that publish one, and forget the others."""
        live = {w.worker_id: w.kv_events for w in workers if w.HasField("kv_events") and w.kv_events.stream}
        for wid in [w for w in self._sources if w not in live]:
            self._last_id.pop(self._sources.pop(wid).stream, None)
            self._joining.discard(wid)
            self._wanted.discard(wid)
        for wid, src in live.items():
            old = self._sources.get(wid)
            if old is None or old.stream != src.stream:
                if old is not None:
                    self._last_id.pop(old.stream, None)
                self._joining.add(wid)
            self._sources[wid] = src
        self.index.retain(live)
        self._wake.set()

    def request_snapshot(self, worker_id: str) -> None:
        """KVEventIndex's way back to a worker: sent by the feed's task (never blocks the caller)."""
        self._wanted.add(worker_id)
        self._wake.set()

    def exact_workers(self) -> int:
        return sum(self.index.has_events(w) for w in self._sources)

    # ---- the task -------------------------------------------------------------------------
    async def _run(self) -> None:
        # `_closed`, not only the cancellation: the client may turn a cancelled read into an error.
        while not self._closed:
            try:
                await self._join()
                await self._send_requests()
                if self._last_id:
                    await self._read()
                else:
                    self._wake.clear()
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self._wake.wait(), self.block_s)
            except asyncio.CancelledError:
                raise
            except Exception as e:
                if self._closed:
                    return
                if not self._down:
                    log.warning("KV event feed from %s failed (will retry): %s", self.url, e)
                self._down = True
                await asyncio.sleep(self.block_s)
                continue
            if self._down:
                log.info("KV event feed from %s recovered", self.url)
                self._down = False
            if self.metrics is not None:
                self.metrics.kv_exact_workers.set(self.exact_workers())

    async def _join(self) -> None:
        for wid in list(self._joining):
            src = self._sources[wid]
            last = await self._client.xrevrange(src.stream, count=1)
            self._last_id[src.stream] = _text(last[0][0]) if last else "0-0"
            self._joining.discard(wid)
            self.request_snapshot(wid)   # from the stream's end: exact after one round trip

    async def _send_requests(self) -> None:
        if not self._wanted:
            return
        pipe = self._client.pipeline(transaction=False)
        for wid in self._wanted:
            key = self._sources[wid].snapshot_requests if wid in self._sources else ""
            if key:
                pipe.rpush(key, "snapshot")
                pipe.expire(key, REQUEST_TTL_S)
        await pipe.execute()
        if self.metrics is not None:
            self.metrics.kv_snapshot_requests.inc(len(self._wanted))
        self._wanted.clear()

    async def _read(self) -> None:
        streams = dict(self._last_id)
        resp = await self._client.xread(streams, count=READ_COUNT, block=max(1, int(self.block_s * 1000)))
        by_stream = {src.stream: wid for wid, src in self._sources.items()}
        for stream, entries in resp or ():
            stream = _text(stream)
            wid = by_stream.get(stream)
            for entry_id, fields in entries:
                if stream in self._last_id:
                    self._last_id[stream] = _text(entry_id)
                if wid is not None:
                    self._apply(wid, fields)

    def _apply(self, wid: str, fields: dict) -> None:
        raw = fields.get(b"m", fields.get("m"))
        try:
            msg = message_from_dict(json.loads(raw))
        except (TypeError, ValueError) as e:
            log.debug("ignoring an unreadable KV event entry from %s: %s", wid, e)
            self._count("invalid", "ignored")
            return
        kind = "batch" if isinstance(msg, KVEventBatch) else "snapshot"
        if msg.worker_id != wid:
            log.debug("ignoring KV events of %s found in %s's stream", msg.worker_id, wid)
            self._count(kind, "ignored")
            return
        result = self.index.apply(msg)
        self._count(kind, "applied" if result.applied else "ignored")
        if result.applied and isinstance(msg, KVEventBatch) and self.metrics is not None:
            self.metrics.kv_events_applied.inc(len(msg.events))

    def _count(self, kind: str, result: str) -> None:
        if self.metrics is not None:
            self.metrics.kv_event_messages.labels(kind, result).inc()


class EventPrefixView:
    """The planner's exact view: tier-weighted cached tokens from the events, or None (fall back)."""

    def __init__(self, index: KVEventIndex):
        self.index = index
        self._namespaces: dict[bytes, Namespace] = {}
        # One prompt's keys, for all its candidates (the token ids are held, so `is` cannot mistake
        # a new prompt for a freed one).
        self._memo: tuple[Sequence[int], Namespace, bytes | None, list[str]] | None = None

    def cached_tokens(self, info: worker_pb2.WorkerInfo, token_ids: Sequence[int] | None,
                      parent: bytes | None = None) -> int | None:
        """`parent`: the key space of a LoRA adapter's prompt (lora_routing.adapter_block_parent)."""
        if token_ids is None or not info.HasField("kv_events") or not self.index.has_events(info.worker_id):
            return None
        ns = self._namespace(info.kv_events.namespace)
        if ns is None:
            return None
        try:
            keys = self._keys(ns, token_ids, parent)
        except ValueError:   # a token id outside int32: the worker refuses it anyway
            return None
        return round(self.index.score(info.worker_id, keys) * ns.page_size)

    def _namespace(self, pb: worker_pb2.KVBlockNamespace) -> Namespace | None:
        raw = pb.SerializeToString(deterministic=True)
        ns = self._namespaces.get(raw)
        if ns is None:
            try:
                ns = Namespace(pb.model, pb.dtype, pb.page_size, pb.num_layers, pb.kv_heads, pb.head_dim)
            except ValueError:
                return None
            if len(self._namespaces) > 64:   # workers of many models / page sizes: keep it bounded
                self._namespaces.clear()
            self._namespaces[raw] = ns
        return ns

    def _keys(self, ns: Namespace, token_ids: Sequence[int], parent: bytes | None) -> list[str]:
        memo = self._memo
        if memo is not None and memo[0] is token_ids and memo[1] == ns and memo[2] == parent:
            return memo[3]
        # A worker always computes the prompt's last token: its cache match stops one token short.
        keys = block_keys(ns, token_ids[:-1], parent)
        self._memo = (token_ids, ns, parent, keys)
        return keys


def _text(v) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)
