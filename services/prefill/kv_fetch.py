"""KV both ways: a prefill worker fetches the part of a prompt its decode peer already holds.

In a multi-turn conversation turn N's answer is computed on D only, and so lives only in D's prefix
cache; turn N+1's prompt repeats it. When the router's cost model finds fetching those pages cheaper
than computing them (services/router/cost.py `fetch_pays`) it sets `PrefillRequest.reuse_decode_kv`,
and the room's request gets a `DecodePrefix` as its PrefixSource (engine/kvcache/kv_manager.py): at
admission P reserves pages for the part D holds beyond P's own cache and asks D (KVSource.SendPrefix)
to write them into P's pool over the same transfer engines and protocol as the forward direction —
D's sender into P's receiver, checksums included. The request is *loading* meanwhile (the scheduler
computes the others), and the fetched pages then join P's prefix cache like computed ones.

Anything that goes wrong — D refuses (the room is gone, its pages moved), the call fails, the bytes
arrive corrupt, D disappears, `timeout_s` passes — ends the fetch with nothing loaded: P computes
those tokens as it would have, and the request is not lost. A request released mid-fetch aborts the
room on P's receiver first, which returns once nothing of it can still land in P's pages.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable, Sequence

import grpc

from tandem.engine.kvcache.tiers.link import LoadJob
from tandem.kvtransfer.base import KVReceiver, RoomState, TransferError
from tandem.services.common.auth import InternalAuth
from tandem.services.worker import metrics
from tandem.services.worker.loop import EngineLoop
from tandem.v1 import worker_pb2, worker_pb2_grpc

log = logging.getLogger(__name__)

RATE_SMOOTHING = 0.3    # weight of the newest fetch in the reported rate and overhead (WorkerLoad.kv_fetch_*)


class KVFetcher:
    """A prefill worker's fetches from decode workers: one receiver room per fetch, keyed by the
    bootstrap room (unique per request attempt), and the SendPrefix call that starts it."""

    def __init__(self, worker_id: str, receiver: KVReceiver, page_size: int, timeout_s: float = 30.0,
                 auth: InternalAuth = InternalAuth()):
        self.worker_id = worker_id
        self.receiver = receiver
        self.page_size = page_size
        self.timeout_s = timeout_s
        self.auth = auth
        self.loop: EngineLoop | None = None
        # How a fetch's SendPrefix reaches D: called on the engine thread, must not block, and calls
        # `refused` if D does not send. `bind` sets the gRPC one; in-process tests call D directly.
        self.ask: Callable[[DecodePrefix, worker_pb2.SendPrefixRequest], None] | None = None
        self.gbps = 0.0                     # smoothed measured transfer rate of successful fetches
        self.overhead_s = 0.0               # smoothed rest of their time: the call, set-up, completion
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._tasks: set[asyncio.Task] = set()

    def bind(self, loop: EngineLoop) -> None:
        """Ask decode workers over gRPC, from `loop`'s event loop."""
        self.loop = loop
        self.ask = lambda src, req: loop.deliver(self._spawn, self._ask_rpc(src, req))

    def source(self, room: int, peer_id: str, peer_addr: str, peer_epoch: int, tokens: int) -> DecodePrefix | None:
        """The PrefixSource of a room whose decode worker holds its prompt's first `tokens` tokens;
        None when D cannot be asked (no address: it predates the field, or nothing to ask it with)."""
        if not peer_addr or self.ask is None or tokens <= 0:
            return None
        return DecodePrefix(self, room, peer_id, peer_addr, peer_epoch, tokens)

    def start(self, src: DecodePrefix, first: int, pages: Sequence[int]) -> LoadJob | None:
        """Engine thread: expect the room on P's receiver, ask D to send (asyncio side) and wait for
        the outcome on a thread of its own, which finishes the job."""
        job = LoadJob(keys=[], pages=list(pages))
        try:
            self.receiver.expect(src.room, job.pages, src.peer_id, peer_epoch=src.peer_epoch)
        except (ValueError, TransferError) as e:   # a fetch that cannot start is computed instead
            log.warning("room %d: cannot fetch KV from %s: %s", src.room, src.peer_id, e)
            return None
        req = worker_pb2.SendPrefixRequest(bootstrap_room=src.room, prefill_worker_id=self.worker_id,
                                           first_page=first, dst_page_ids=job.pages,
                                           transfer_metadata=self.receiver.metadata())
        self.ask(src, req)
        threading.Thread(target=self._wait, args=(src, job), daemon=True, name=f"kv-fetch-{src.room:x}").start()
        return job

    def cancel(self, src: DecodePrefix, job: LoadJob) -> None:
        """Returns once nothing of the fetch can still land in its pages."""
        job.cancelled = True
        self.receiver.abort(src.room)
        job.done.wait()

    # --- internals ---------------------------------------------------------------------------
    def _spawn(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def refused(self, src: DecodePrefix, error: str) -> None:
        """D will not send (any thread): the fetch ends now with nothing loaded."""
        log.info("room %d: decode worker %s did not send its KV (%s); computing it", src.room, src.peer_id, error)
        self.receiver.abort(src.room)

    async def _ask_rpc(self, src: DecodePrefix, req: worker_pb2.SendPrefixRequest) -> None:
        try:
            ch = self._channels.get(src.peer_addr)
            if ch is None:
                ch = self._channels[src.peer_addr] = self.auth.channel(src.peer_addr)
            resp = await worker_pb2_grpc.KVSourceStub(ch).SendPrefix(req, timeout=self.timeout_s)
            error = None if resp.accepted else resp.error
        except grpc.aio.AioRpcError as e:
            error = f"{e.code().name}: {e.details()}"
        if error is not None:
            await asyncio.to_thread(self.refused, src, error)

    def _wait(self, src: DecodePrefix, job: LoadJob) -> None:
        t0 = time.monotonic()
        status = self.receiver.wait(src.room, self.timeout_s)
        if not status.state.done:
            self.receiver.abort(src.room)
            status = self.receiver.poll(src.room)
        if status.state is RoomState.SUCCESS and not job.cancelled:
            job.loaded = len(job.pages)
            total = time.monotonic() - t0
            moving = min(max(status.seconds, 1e-6), total)
            self.gbps = _smooth(self.gbps, status.bytes_moved * 8 / moving / 1e9)
            self.overhead_s = _smooth(self.overhead_s, total - moving)
            log.debug("room %d: fetched %d pages (%d bytes) from %s in %.1f ms, %.1f ms of it moving bytes",
                      src.room, len(job.pages), status.bytes_moved, src.peer_id, total * 1e3, moving * 1e3)
            metrics.KV_FETCHES.labels("success").inc()
            metrics.KV_FETCHED_TOKENS.inc(len(job.pages) * self.page_size)
        else:
            metrics.KV_FETCHES.labels("cancelled" if job.cancelled else "failed").inc()
            if not job.cancelled:
                log.warning("room %d: KV fetch from %s failed (%s); computing it", src.room, src.peer_id,
                            status.error or "timed out")
        self.receiver.release(src.room)
        job.done.set()

    async def close(self) -> None:
        for ch in self._channels.values():
            await ch.close()


def _smooth(old: float, new: float) -> float:
    return new if not old else (1 - RATE_SMOOTHING) * old + RATE_SMOOTHING * new


class DecodePrefix:
    """A room's decode worker as its request's PrefixSource (engine/kvcache/kv_manager.py)."""

    def __init__(self, fetcher: KVFetcher, room: int, peer_id: str, peer_addr: str, peer_epoch: int, tokens: int):
        self.fetcher, self.room = fetcher, room
        self.peer_id, self.peer_addr, self.peer_epoch = peer_id, peer_addr, peer_epoch
        self.tokens = tokens

    def start_load(self, first: int, last: int, pages: Sequence[int]) -> LoadJob | None:
        return self.fetcher.start(self, first, pages)

    def cancel(self, job: LoadJob) -> None:
        self.fetcher.cancel(self, job)
