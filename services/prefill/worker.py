"""The prefill worker's engine-thread side: bootstrap queue -> chunked prefill -> inflight transfers.

Runs only on the engine thread (see services/worker/loop.py). A room's prefill starts when the router's
Prefill arrives, while D reserves its pages (its Bootstrap: D's admission waits for a decode step, ~20
ms p50 on a 2-core box, that a first token no longer waits for); nothing is sent before the Bootstrap,
which then carries what was computed so far, and P's room cap (`max_rooms`) bounds the prompts that
wait for one. A room that fetches from D (below) starts only once D has said what it holds. The pages
a prefill chunk completes are written to D while the chunk's forward pass
runs, `stream_layers` layers at a time as soon as those layers' KV is in the pool (where D's data
path takes layer writes: tcp, nixl), so that little is left to send after the last layer; else after
the chunk. With the last chunk the first token goes along as the aux record. P keeps the prompt's
pages until the transfer reports success or failure, then releases them into its prefix cache. Before each step P reports the
progress of its bootstrapped rooms to their decode workers (progress.py), whose transfer timeout
follows it. When the router asks (`reuse_decode_kv`), the room's request fetches what D holds of
the prompt beyond P's own cache from D instead of computing it (kv_fetch.py).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import OrderedDict
from collections.abc import Callable

from tandem.engine.engine import LLMEngine
from tandem.engine.errors import InvalidRequest, ResourceExhausted
from tandem.engine.outputs import FinishReason
from tandem.engine.sampling_params import SamplingParams
from tandem.engine.scheduler.batch import SampledToken
from tandem.kvtransfer.base import KVSender, RoomState
from tandem.services.prefill.kv_fetch import KVFetcher
from tandem.services.prefill.progress import ProgressReporter
from tandem.services.prefill.rooms import BootstrapInfo, PrefillRoom
from tandem.services.worker import metrics
from tandem.services.worker.convert import step_cost_to_pb
from tandem.v1 import generation_pb2, worker_pb2

log = logging.getLogger(__name__)


# Failed rooms remembered so that a Bootstrap arriving after the failure is refused, not held until
# its timeout: far more than can be in flight between a failure and the Bootstrap it outruns.
FAILED_ROOMS_KEPT = 4096


@dataclasses.dataclass(frozen=True)
class PrefillTimeouts:
    bootstrap_s: float = 30.0       # Prefill (or Bootstrap) arrived but its counterpart never did
    transfer_s: float = 30.0        # aux queued but the transfer never completed


class PrefillWorker:
    def __init__(self, engine: LLMEngine, sender: KVSender, timeouts: PrefillTimeouts, max_rooms: int = 1024,
                 stream_layers: int = 0, fetcher: KVFetcher | None = None):
        self.engine = engine
        self.fetcher = fetcher          # KV both ways: fetches from decode workers (None: never fetch)
        self.sched = engine.scheduler
        self._export_tiers = metrics.kv_tier_exporter(engine)
        self.sender = sender
        self.timeouts = timeouts
        self.max_rooms = max_rooms
        self.rooms: dict[int, PrefillRoom] = {}
        self._by_rid: dict[str, PrefillRoom] = {}
        self._failed: OrderedDict[int, str] = OrderedDict()   # rooms that failed before D's Bootstrap came
        self.page_size = engine.cfg.page_size
        self.outstanding_seen = 0
        self.progress = ProgressReporter(sender)
        metrics.QUEUE_CAP.labels("bootstrap").set(max_rooms)
        # Streaming needs the forward pass on this thread (no overlap) and the KV in CPU memory when
        # a layer returns (on CUDA it is only queued then).
        self.stream_layers = stream_layers if not engine.overlap and engine.runner.device.type == "cpu" else 0
        self.num_layers = engine.runner.model_cfg.num_layers
        self._stream_failed: dict[int, str] = {}    # room -> why a layer write could not be queued
        if self.stream_layers > 0:
            engine.runner.layer_hook = self._layer_writes

    # --- commands (called via EngineLoop.call) -----------------------------------------------
    def add_prefill(self, room_id: int, rid: str, prompt, params: SamplingParams, on_done, priority: int = 0,
                    resume_ids=(), lora: str | None = None, reuse_decode_kv: bool = False) -> PrefillRoom:
        """The router's Prefill: validate and wait for D's Bootstrap. Returns its room (whose stamps
        the servicer reads once it is done); raises InvalidRequest."""
        if room_id in self.rooms and self.rooms[room_id].req is not None:
            raise InvalidRequest(f"bootstrap room {room_id} is already in use", "bootstrap_room")
        if rid in self._by_rid:
            raise InvalidRequest(f"request id {rid!r} is already in flight", "request_id")
        room = self.rooms.get(room_id)
        if room is None:
            self._check_capacity()
        # P samples exactly one token (after the resumed ones, which count against max_tokens); D
        # validates the whole request (context, max_tokens) too.
        req = self.engine.make_request(prompt, dataclasses.replace(params, max_tokens=1 + len(resume_ids)), rid,
                                       priority, resume_ids, lora)
        if room is None:
            room = self.rooms[room_id] = PrefillRoom(room_id)
        room.req, room.on_done, room.reuse_decode_kv = req, on_done, reuse_decode_kv
        self._by_rid[rid] = room
        if room.ready:
            self._start(room)
        elif not (reuse_decode_kv and self.fetcher is not None):
            self._admit(room)   # computes while D reserves its pages; sends nothing before D's Bootstrap
        return room

    def bootstrap(self, room_id: int, info: BootstrapInfo) -> None:
        """D's Bootstrap: its pages are reserved. Raises InvalidRequest / ResourceExhausted."""
        room = self.rooms.get(room_id)
        if room is None:
            if room_id in self._failed:   # its prefill failed before this came: D fails it now, not at its timeout
                raise InvalidRequest(f"room {room_id} already failed on this prefill worker: {self._failed[room_id]}",
                                     "bootstrap_room")
            self._check_capacity()
            room = self.rooms[room_id] = PrefillRoom(room_id)
        elif room.info is not None:
            raise InvalidRequest(f"room {room_id} was already bootstrapped", "bootstrap_room")
        room.info = info
        room.state = RoomState.WAITING_FOR_INPUT
        if room.ready:
            self._start(room)

    def abort_room(self, room_id: int, reason: str) -> bool:
        """Fail a room wherever it is; returns only when no write of it can still land on D."""
        room = self.rooms.get(room_id)
        if room is None:
            return False
        self._fail(room, f"aborted: {reason}")
        return True

    def abort_request(self, rid: str, reason: str) -> None:
        room = self._by_rid.get(rid)
        if room is not None:
            self._fail(room, f"aborted: {reason}")

    # --- engine loop -------------------------------------------------------------------------
    def has_work(self) -> bool:
        return self.engine.has_work()

    def step(self) -> None:
        self.progress.before_step(self.sched, self._by_rid)
        t0, began = time.perf_counter(), time.monotonic()
        finished = self.engine.advance()
        ended = time.monotonic()
        self.progress.pace.observe(sum(len(s.input_ids) for batch, _ in finished for s in batch.seqs),
                                   time.perf_counter() - t0)
        # With overlap, `advance` launches the next chunk before this one's pages are sent, so
        # each send uses the step's own extent, not the request's (already advanced) count.
        for room_id, why in self._stream_failed.items():
            if (room := self.rooms.get(room_id)) is not None:
                self._fail(room, f"KV transfer failed: {why}")
        self._stream_failed.clear()
        for batch, sampled in finished:
            metrics.STEPS.labels("prefill").inc()
            done = {req.rid: tok for req, tok in sampled}
            for seq in batch.seqs:
                room = self._by_rid.get(seq.req.rid)
                if room is None or room.state.done:
                    continue
                room.chunks.append((began, ended, len(seq.input_ids)))
                tok = done.get(seq.req.rid)
                if isinstance(tok, list):   # structured output: the grammar refused the only token there was
                    self._fail(room, "structured output: the grammar left no legal first token")
                    continue
                room.computed = seq.prefix_len + len(seq.input_ids)
                if tok is not None:
                    self.sched.detach(room.req)  # keep the pages until the transfer is done
                if not room.ready:               # D's Bootstrap has not come: _start sends all of it
                    room.early_token = tok
                    continue
                self._send(room, room.computed, final=tok is not None)
                if tok is not None:
                    self._finish_prefill(room, tok)

    def tick(self) -> None:
        now = time.monotonic()
        for room in list(self.rooms.values()):
            if room.finished_at is not None:
                status = self.sender.status(room.room)
                if status.state is RoomState.SUCCESS:
                    self._complete(room, status)
                elif status.state is RoomState.FAILED:
                    self._fail(room, f"KV transfer failed: {status.error}")
                elif now - room.finished_at > self.timeouts.transfer_s:
                    self._fail(room, f"KV transfer timed out after {self.timeouts.transfer_s:g}s")
            elif not room.ready and now - room.created > self.timeouts.bootstrap_s:
                missing = "decode worker's bootstrap" if room.info is None else "router's prefill request"
                self._fail(room, f"bootstrap timed out after {self.timeouts.bootstrap_s:g}s waiting for the {missing}")
        self._export_metrics()

    def polling(self) -> bool:
        return bool(self.rooms)

    def on_idle(self) -> None:
        if self.rooms:
            return  # rooms still waiting for their counterpart hold nothing, but are not idle
        metrics.idle_check(self.engine)

    # --- peer liveness (services/worker/peers.py) ---------------------------------------------
    def watched_peers(self) -> dict[str, str]:
        """The decode workers this worker owes KV: rooms they bootstrapped that are not done."""
        return {r.info.peer_id: r.info.peer_addr for r in self.rooms.values()
                if r.info is not None and r.info.peer_addr and not r.state.done}

    def peer_lost(self, peer_id: str, reason: str) -> None:
        """A decode worker stopped answering: fail only the rooms bound for it."""
        for room in [r for r in self.rooms.values() if r.info is not None and r.info.peer_id == peer_id]:
            self._fail(room, f"decode worker {peer_id} is unreachable: {reason}")

    # --- internals ---------------------------------------------------------------------------
    def _check_capacity(self) -> None:
        if len(self.rooms) >= self.max_rooms:
            raise ResourceExhausted(f"prefill bootstrap queue is full ({self.max_rooms} rooms)")

    def _start(self, room: PrefillRoom) -> None:
        """Both halves are here: check D's pages against the prompt, then admit the room, or (admitted
        before the Bootstrap) send what it has computed so far."""
        try:
            _check_pages(room.req.prompt_ids, room.info, self.page_size)
            ours = room.req.lora.digest if room.req.lora is not None else ""
            if ours != room.info.lora_digest:   # the KV would be another model's
                raise InvalidRequest(f"LoRA adapter mismatch: the decode worker applies "
                                     f"{room.info.lora_digest[:12] or 'none'}, this prefill {ours[:12] or 'none'}",
                                     "lora")
        except InvalidRequest as e:
            self._fail(room, str(e))  # answered through the Prefill RPC's FAILED response
            return
        if room.started_at is None:
            if room.reuse_decode_kv and self.fetcher is not None:
                # D holds the first decode_prefix_len tokens; admission fetches what P's cache lacks of them.
                info = room.info
                room.req.kv_source = self.fetcher.source(room.room, info.peer_id, info.peer_addr, info.peer_epoch,
                                                         info.decode_prefix_len)
            if not self._admit(room):
                return
        self.progress.admitted(room)
        if room.computed:   # computed before D's Bootstrap: send it now (all of it, with the first token, if done)
            self._send(room, room.computed, final=room.early_token is not None)
            if room.early_token is not None:
                room.waited_bootstrap = (room.chunks[-1][1], time.monotonic())
                self._finish_prefill(room, room.early_token)

    def _admit(self, room: PrefillRoom) -> bool:
        """Into the scheduler; False: the room failed (the Prefill RPC has its answer)."""
        room.started_at = time.monotonic()
        try:
            self.sched.add(room.req)
            return True
        except InvalidRequest as e:
            self._fail(room, str(e))
        except ResourceExhausted as e:
            self._fail(room, str(e), rejection=e)  # the caller's answer: RESOURCE_EXHAUSTED, not a retry
        finally:
            for req, err in self.sched.take_evicted():  # lower-priority rooms this one pushed out
                self._fail(self._by_rid[req.rid], str(err), rejection=err)
        return False

    def _layer_writes(self, batch) -> Callable[[int], None] | None:
        """The model runner's layer hook, called as a step's forward pass is built: the pages this step
        completes, of the rooms whose decode worker takes layer writes, claimed now and sent every
        `stream_layers` layers (and after the last) while the pass runs. None: nothing to stream."""
        sends = []
        for seq in batch.seqs:
            room = self._by_rid.get(seq.req.rid)
            if room is None or room.state.done or not room.ready or not self.sender.writes_layers(room.info.peer_id):
                continue
            computed = seq.prefix_len + len(seq.input_ids)
            src, dst = room.pages_to_send(self.page_size, computed, final=computed >= len(room.req.prompt_ids))
            if src:
                room.state = RoomState.TRANSFERRING
                sends.append((room, src, dst))
        if not sends:
            return None
        group, last = self.stream_layers, self.num_layers - 1

        def after_layer(i: int) -> None:
            if (i + 1) % group and i != last:
                return
            for room, src, dst in sends:
                if room.room in self._stream_failed:
                    continue
                try:
                    self.sender.write(room.info.peer_id, room.room, src, dst, layers=(i // group * group, i + 1))
                except Exception as e:  # noqa: BLE001 - the room fails after the step, the pass goes on
                    self._stream_failed[room.room] = f"{type(e).__name__}: {e}"

        return after_layer

    def _send(self, room: PrefillRoom, computed: int, final: bool) -> None:
        src, dst = room.pages_to_send(self.page_size, computed, final)
        if src:
            room.state = RoomState.TRANSFERRING
            self.sender.write(room.info.peer_id, room.room, src, dst)

    def _finish_prefill(self, room: PrefillRoom, tok: SampledToken) -> None:
        req = room.req
        aux = worker_pb2.AuxRecord(
            bootstrap_room=room.room, first_token=tok.token_id, logprob=tok.logprob or 0.0,
            top=[generation_pb2.TopLogprob(token_id=t, logprob=lp) for t, lp in (tok.top or [])],
            cached_tokens=req.cache_len,
        )
        self.sender.finish(room.info.peer_id, room.room, aux.SerializeToString())
        room.state = RoomState.TRANSFERRING
        room.finished_at = time.monotonic()

    def _complete(self, room: PrefillRoom, status) -> None:
        room.state = RoomState.SUCCESS
        if status.seconds > 0:
            metrics.TRANSFER_SPEED.set(status.bytes_moved / status.seconds / 1e9)
            metrics.TRANSFER_LATENCY.observe(status.seconds * 1e3)
        metrics.REQUESTS.labels("success").inc()
        self._close(room, status.bytes_moved, status.seconds)

    def _fail(self, room: PrefillRoom, error: str, rejection: BaseException | None = None) -> None:
        if room.state.done:
            return
        log.warning("room %d (%s) failed: %s", room.room, room.req.rid if room.req else "-", error)
        room.state, room.error, room.rejection = RoomState.FAILED, error, rejection
        if room.info is not None:
            self.sender.abort(room.room)  # returns once no write of this room can land on D
        else:                             # D's Bootstrap may still come: refuse it at once
            self._failed[room.room] = error
            while len(self._failed) > FAILED_ROOMS_KEPT:
                self._failed.popitem(last=False)
        metrics.REQUESTS.labels("failed").inc()
        self._close(room, 0, 0.0)

    def _close(self, room: PrefillRoom, nbytes: int, seconds: float) -> None:
        """The one exit of a room: free its pages/slot, forget it, answer the Prefill RPC."""
        req = room.req
        if req is not None:
            if req.finished:           # detached after its last chunk: pages still held
                self.sched.release(req, req.prompt_ids)
            else:                      # queued or mid-prefill
                self.sched.finish(req, FinishReason.ABORT)
            self.engine.forget(req.rid)
            self._by_rid.pop(req.rid, None)
        self.sender.release(room.room)
        self.progress.forget(room)
        self.rooms.pop(room.room, None)
        if room.on_done is not None and room.rejection is not None:
            room.on_done(room.rejection)
        elif room.on_done is not None:
            room.on_done(worker_pb2.PrefillResponse(
                request_id=req.rid if req else "", bootstrap_room=room.room,
                state=_STATE_PB[room.state], error=room.error,
                cached_tokens=req.cache_len if req else 0, fetched_tokens=req.fetched_tokens if req else 0,
                transfer_ms=seconds * 1e3, transfer_bytes=nbytes,
            ))

    def _export_metrics(self) -> None:
        waiting_bootstrap = sum(1 for r in self.rooms.values() if not r.ready)
        inflight = sum(1 for r in self.rooms.values() if r.finished_at is not None)
        stats = self.sched.stats()
        metrics.QUEUE_LEN.labels("bootstrap").set(waiting_bootstrap)
        metrics.QUEUE_LEN.labels("waiting").set(stats.waiting)
        metrics.QUEUE_LEN.labels("prefilling").set(stats.prefilling)
        metrics.QUEUE_LEN.labels("inflight").set(inflight)
        metrics.export_kv(stats)
        self._export_tiers()
        self.outstanding_seen = self.outstanding()  # read by the asyncio side while draining
        metrics.KV_TRANSFERS_OUTSTANDING.set(self.outstanding_seen)
        metrics.export_vllm_compatible(self.engine.cfg.model, self.load())

    def outstanding(self) -> int:
        """KV transfers this worker owes: rooms a decode worker bootstrapped (reserved pages for) and
        that have not completed or failed yet. A drain waits for this to reach 0."""
        return sum(1 for r in self.rooms.values() if r.info is not None and not r.state.done)

    def load(self) -> worker_pb2.WorkerLoad:
        stats = self.sched.stats()
        unstarted = sum(len(r.req.prompt_ids) for r in self.rooms.values() if r.req is not None and r.started_at is None)
        return worker_pb2.WorkerLoad(
            running=stats.prefilling, waiting=stats.waiting + len(self.rooms),
            free_pages=stats.free_pages, total_pages=stats.total_pages,
            prefill_tokens=unstarted + stats.prefill_tokens, step_cost=step_cost_to_pb(self.sched.cost),
            kv_fetch_gbps=self.fetcher.gbps if self.fetcher is not None else 0.0,
            kv_fetch_overhead_ms=self.fetcher.overhead_s * 1e3 if self.fetcher is not None else 0.0,
        )


def _check_pages(prompt_ids: list[int], info: BootstrapInfo, page_size: int) -> None:
    if info.decode_prefix_len % page_size or info.decode_prefix_len >= max(1, len(prompt_ids)):
        raise InvalidRequest(f"decode_prefix_len {info.decode_prefix_len} is not a page-aligned prefix "
                             f"of the {len(prompt_ids)}-token prompt", "decode_prefix_len")
    need = -(-len(prompt_ids) // page_size) - info.decode_prefix_len // page_size
    if len(info.dst_pages) != need:
        raise InvalidRequest(f"decode worker reserved {len(info.dst_pages)} pages; the prompt needs {need}",
                             "dst_page_ids")


_STATE_PB = {
    RoomState.BOOTSTRAPPING: worker_pb2.TRANSFER_STATE_BOOTSTRAPPING,
    RoomState.WAITING_FOR_INPUT: worker_pb2.TRANSFER_STATE_WAITING_FOR_INPUT,
    RoomState.TRANSFERRING: worker_pb2.TRANSFER_STATE_TRANSFERRING,
    RoomState.SUCCESS: worker_pb2.TRANSFER_STATE_SUCCESS,
    RoomState.FAILED: worker_pb2.TRANSFER_STATE_FAILED,
}
