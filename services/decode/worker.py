"""The decode worker's engine-thread side: prealloc queue -> transfer queue -> running batch.

A request waits in the bounded prealloc queue until D has a slot and pages for its whole prompt
(reusing D's own prefix cache). When D's KV tiers hold more of the prompt than its pool, the room
waits in `loading` until that load is done (the Bootstrap carries D's final prefix length); the
other rooms and the running batch go on meanwhile. Then D tells its receiver to expect the room, asks
the asyncio side to send P the Bootstrap (D's pages, D's prefix length), and polls the receiver. When
the aux record arrives (room id checked), the request joins the running continuous batch with its
first token.
Every exit (success, client cancel, transfer failure, timeout) goes through `_drop`.

The transfer timeout is time without progress, not time for the whole transfer: the prefill worker
reports each room's progress (services/prefill/progress.py), and a long prompt on a slow CPU is
waited for as long as those reports keep coming (see `DecodeTimeouts.deadline`).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from typing import Protocol

import grpc

from tandem.engine.engine import LLMEngine
from tandem.engine.errors import GrammarViolation, InvalidRequest, ResourceExhausted
from tandem.engine.outputs import RequestOutput
from tandem.engine.scheduler.batch import SampledToken
from tandem.engine.scheduler.queue_policy import PolicyQueue
from tandem.engine.scheduler.request import Request
from tandem.kvtransfer.base import KVReceiver, KVSender, Progress, RoomState
from tandem.services.common.grpc_errors import RpcFailed
from tandem.services.worker import metrics
from tandem.services.worker.convert import step_cost_to_pb
from tandem.v1 import worker_pb2

log = logging.getLogger(__name__)


class PrefillPeers(Protocol):
    """How the engine thread reaches prefill workers (implemented on the asyncio side)."""

    def send_bootstrap(self, room: DecodeRoom, req: worker_pb2.BootstrapRequest) -> None: ...

    def send_abort(self, room: DecodeRoom, reason: str) -> None: ...


class TransferFailed(RpcFailed):
    """The prompt's KV never arrived (prefill worker failed, aborted or timed out): UNAVAILABLE.
    `prefill_id` names the prefill worker it is due to (the router retries without it)."""

    def __init__(self, message: str, prefill_id: str = ""):
        super().__init__(grpc.StatusCode.UNAVAILABLE, message, failed_worker=prefill_id)


@dataclasses.dataclass(frozen=True)
class DecodeTimeouts:
    transfer_s: float = 30.0        # seconds without progress from the prefill worker (--transfer-timeout)
    # A report promises the next within `expected_s`; D allows `progress_factor` times that on top of
    # `transfer_s`, because P's estimate comes from its earlier steps, and a chunk deep in a long prompt
    # costs more per token (attention over more context) than those did.
    progress_factor: float = 2.0
    max_expected_s: float = 3600.0  # a report keeps a room at most this much longer than transfer_s

    def deadline(self, bootstrapped_at: float, progress: Progress | None, landed_at: float = 0.0) -> float:
        """When a room still waiting for its KV fails (time.monotonic()): `transfer_s` after the
        bootstrap, after the prefill worker's last report plus the slack that report asked for, or
        after the last piece of its KV landed (a computed prompt's KV crossing a slow link: P reports
        no more progress, but its bytes keep arriving, and the room waits as long as they do)."""
        deadline = max(bootstrapped_at, landed_at) + self.transfer_s
        if progress is not None:
            slack = self.progress_factor * min(progress.expected_s, self.max_expected_s)
            deadline = max(deadline, progress.at + self.transfer_s + slack)
        return deadline


@dataclasses.dataclass(eq=False)
class DecodeRoom:
    room: int
    req: Request
    prefill_addr: str
    prefill_id: str
    emit: Callable[[RequestOutput | BaseException], None]  # delivers to the Decode stream
    state: RoomState = RoomState.BOOTSTRAPPING
    created: float = dataclasses.field(default_factory=time.monotonic)
    bootstrapped_at: float | None = None
    kv_ready_at: float | None = None  # its KV arrived (a stamp for the request's trace)
    outlived_timeout: bool = False  # still waited for, thanks to progress, after transfer_s from the bootstrap
    prefill_epoch: int = 0          # boot epoch of the prefill instance the router paired (0: unchecked)
    prefix_sent: bool = False       # this room's cached prefix pages are being sent to P (kv_source.py)

    # The prealloc queue orders rooms by their request's priority and arrival (queue_policy).
    @property
    def priority(self) -> int:
        return self.req.priority

    @property
    def arrival(self) -> float:
        return self.req.arrival


class DecodeWorker:
    def __init__(self, engine: LLMEngine, receiver: KVReceiver, timeouts: DecodeTimeouts,
                 peers: PrefillPeers, max_prealloc: int = 1024):
        self.engine = engine
        self.sched = engine.scheduler
        self._export_tiers = metrics.kv_tier_exporter(engine)
        self._integrity_seen: dict[str, int] = {}   # receiver's integrity failures per path already counted
        self.receiver = receiver
        self.timeouts = timeouts
        self.peers = peers                     # sends Bootstrap / AbortRoom on the asyncio side
        self.max_prealloc = max_prealloc
        self.prealloc: PolicyQueue[DecodeRoom] = self.sched.new_queue()
        self.transfer: dict[int, DecodeRoom] = {}
        self.loading: dict[int, DecodeRoom] = {}   # reserved, prefix loading from the KV tiers; no Bootstrap yet
        self.streams: dict[str, DecodeRoom] = {}   # rid -> room, for every request in flight
        self.prefix_sender: KVSender | None = None  # KV both ways: set once a prefill worker asks (kv_source.py)
        metrics.QUEUE_CAP.labels("prealloc").set(max_prealloc)

    # --- commands ----------------------------------------------------------------------------
    def add(self, room: DecodeRoom) -> None:
        """Queue a validated request (see LLMEngine.make_request). Raises ResourceExhausted when the
        prealloc queue is full and this request is the one served last; otherwise the one served
        last (lower priority) fails with RESOURCE_EXHAUSTED through its stream."""
        if room.room in self.transfer or room.room in self.loading or any(r.room == room.room for r in self.prealloc):
            self.engine.forget(room.req.rid)
            raise TransferFailed(f"bootstrap room {room.room} is already in use")
        out = self.prealloc.offer(room, self.max_prealloc)
        policy = self.prealloc.policy
        if out is room:
            self.engine.forget(room.req.rid)
            raise ResourceExhausted(policy.queue_full_message("decode prealloc queue", self.max_prealloc, room))
        self.streams[room.req.rid] = room
        if out is not None:
            self._drop(out, ResourceExhausted(
                policy.evicted_message("decode prealloc queue", self.max_prealloc, out, room)), reason="queue full")

    def add_local(self, room: DecodeRoom) -> None:
        """Conditional disaggregation: the router sent no prefill worker, so the prompt is prefilled
        here by the scheduler (mixed chunks beside the running decodes, this worker's prefix cache).
        Raises ResourceExhausted when the waiting queue is full and this request is the one turned away."""
        try:
            self.sched.add(room.req)
        except Exception:
            self.engine.forget(room.req.rid)
            raise
        self.streams[room.req.rid] = room
        for rid, err in self.engine.take_evicted():  # lower-priority local prefills this one pushed out
            evicted = self.streams.pop(rid, None)
            if evicted is not None:
                metrics.REQUESTS.labels("failed").inc()
                evicted.emit(err)

    def bootstrap_done(self, room_id: int, error: str | None) -> None:
        """The Bootstrap RPC's answer (called back from the asyncio side)."""
        room = self.transfer.get(room_id)
        if room is None:
            return
        if error:
            self._drop(room, TransferFailed(f"bootstrap with prefill worker {room.prefill_id} failed: {error}",
                                            room.prefill_id))
        elif room.state is RoomState.BOOTSTRAPPING:
            room.state = RoomState.WAITING_FOR_INPUT

    def send_prefix(self, room_id: int, peer_id: str, first_page: int, dst_pages: list[int]) -> None:
        """KV both ways (kv_source.py): queue the write of the room's cached prompt pages `first_page...`
        (which its request keeps locked until it ends) into the prefill worker's `dst_pages`, and the
        room's completion after them. On the engine thread, so that a drop of the room (which aborts
        the send before its pages are freed) comes entirely before or after. Raises InvalidRequest."""
        room = self.transfer.get(room_id)
        if room is None or room.prefill_id != peer_id:
            raise InvalidRequest(f"room {room_id} is not waiting for KV from {peer_id} here", "bootstrap_room")
        if room.prefix_sent:
            raise InvalidRequest(f"room {room_id}'s prefix was already sent", "bootstrap_room")
        req, ps = room.req, self.engine.cfg.page_size
        if not dst_pages or (first_page + len(dst_pages)) * ps > req.cache_len:
            raise InvalidRequest(f"pages {first_page}..{first_page + len(dst_pages) - 1} are not all in the "
                                 f"{req.cache_len} prompt tokens this worker holds", "dst_page_ids")
        room.prefix_sent = True
        self.prefix_sender.write(peer_id, room_id, req.pages[first_page:first_page + len(dst_pages)], dst_pages)
        self.prefix_sender.finish(peer_id, room_id, b"prefix")

    def _end_prefix_send(self, room: DecodeRoom) -> None:
        """Before the room's pages may be freed: no write of its prefix can still read them."""
        if room.prefix_sent:
            self.prefix_sender.release(room.room)   # aborts one still running

    def cancel(self, rid: str) -> None:
        """The client went away: abort the request wherever it is."""
        room = self.streams.get(rid)
        if room is not None:
            self._drop(room, None, reason="cancelled by client")

    # --- engine loop -------------------------------------------------------------------------
    def has_work(self) -> bool:
        return self.engine.has_work()

    def step(self) -> None:
        for out in self.engine.step():
            room = self.streams.get(out.rid)
            if room is None:
                continue
            room.emit(out)
            if out.finished:
                self.streams.pop(out.rid, None)
                metrics.REQUESTS.labels("success").inc()
        metrics.STEPS.labels("decode").inc()

    def tick(self) -> None:
        self._admit()
        self._poll_transfers()
        self._export_metrics()

    def polling(self) -> bool:
        return bool(self.prealloc or self.transfer or self.loading)

    def on_idle(self) -> None:
        if self.prealloc or self.transfer or self.loading:
            return
        metrics.idle_check(self.engine)

    # --- peer liveness (services/worker/peers.py) ---------------------------------------------
    def watched_peers(self) -> dict[str, str]:
        """The prefill workers this worker waits on: queued and bootstrapped rooms."""
        return {r.prefill_id: r.prefill_addr for r in self._rooms() if r.prefill_addr}

    def peer_lost(self, peer_id: str, reason: str) -> None:
        """A prefill worker stopped answering: fail only the rooms that wait on it."""
        for room in [r for r in self._rooms() if r.prefill_id == peer_id]:
            self._drop(room, TransferFailed(f"prefill worker {peer_id} is unreachable: {reason}", peer_id),
                       reason="prefill worker unreachable")

    # --- internals ---------------------------------------------------------------------------
    def _rooms(self) -> tuple[DecodeRoom, ...]:
        """Rooms not running yet: queued, loading their prefix, bootstrapped."""
        return (*self.prealloc, *self.loading.values(), *self.transfer.values())

    def _admit(self) -> None:
        # Rooms whose prefix finished loading from the KV tiers are bootstrapped in reservation
        # order; one still loading holds back none of the others.
        self.sched.poll_loads()
        for room in [r for r in self.loading.values() if not self.sched.is_loading(r.req)]:
            del self.loading[room.room]
            self._bootstrap(room)
        while self.prealloc:
            room = self.prealloc[0]
            req = room.req
            if not self.sched.reserve(req, pending=(r.req for r in (*self.loading.values(), *self.transfer.values()))):
                return
            self.prealloc.popleft()
            if self.sched.is_loading(req):
                self.loading[room.room] = room   # its cache_len (the Bootstrap's prefix) is not final yet
            else:
                self._bootstrap(room)

    def _bootstrap(self, room: DecodeRoom) -> None:
        ps = self.engine.cfg.page_size
        req = room.req
        first = req.cache_len // ps
        dst = req.pages[first:-(-len(req.prompt_ids) // ps)]
        self.receiver.expect(room.room, dst, room.prefill_id, peer_epoch=room.prefill_epoch)
        self.transfer[room.room] = room
        room.bootstrapped_at = time.monotonic()  # the transfer timeout runs from here, not from queueing
        self.peers.send_bootstrap(room, worker_pb2.BootstrapRequest(
            bootstrap_room=room.room, dst_page_ids=dst, decode_prefix_len=req.cache_len, page_size=ps,
            lora_digest=req.lora.digest if req.lora is not None else "",
        ))

    def _poll_transfers(self) -> None:
        # Rooms failed by their checksums (never decoded from: the router retries them on another pair),
        # counted from the receiver, which sees every one: a room the router aborted first is never polled.
        for path, n in dict(getattr(self.receiver, "integrity_by_path", {})).items():   # a copy in one step
            if (gained := n - self._integrity_seen.get(path, 0)) > 0:
                metrics.KV_INTEGRITY_FAILURES.labels(path).inc(gained)
                self._integrity_seen[path] = n
        now = time.monotonic()
        for room in list(self.transfer.values()):
            status = self.receiver.poll(room.room)
            if status.state is RoomState.SUCCESS:
                self._start_decoding(room, status)
            elif status.state is RoomState.FAILED:
                where = f" at {room.prefill_addr} over {status.path}" if status.corrupt else ""
                self._drop(room, TransferFailed(f"KV transfer from prefill worker {room.prefill_id}{where} failed: "
                                                f"{status.error}", room.prefill_id))
            elif now > self.timeouts.deadline(room.bootstrapped_at, status.progress, status.landed_at):
                self._drop(room, TransferFailed(self._timeout_message(room, status.progress, now, status.landed_at),
                                                room.prefill_id),
                           reason="transfer timeout")
            elif not room.outlived_timeout and now - room.bootstrapped_at > self.timeouts.transfer_s:
                room.outlived_timeout = True
                metrics.TRANSFER_OUTLIVED_TIMEOUT.inc()

    def _timeout_message(self, room: DecodeRoom, progress: Progress | None, now: float, landed_at: float = 0.0) -> str:
        head = f"KV transfer from prefill worker {room.prefill_id} timed out"
        limit = f"--transfer-timeout {self.timeouts.transfer_s:g}s"
        if landed_at and (progress is None or self.timeouts.deadline(0.0, None, landed_at)
                          >= self.timeouts.deadline(0.0, progress)):   # the pieces set the deadline
            return f"{head}: none of its KV landed for {now - landed_at:.1f}s after the last piece ({limit})"
        if progress is None:
            return f"{head}: no progress report for {now - room.bootstrapped_at:.1f}s after the bootstrap ({limit})"
        return (f"{head}: no progress for {now - progress.at:.1f}s (last report: {progress.tokens_done} of "
                f"{progress.tokens_total} prompt tokens done, {progress.queued_ahead} queued ahead; {limit})")

    def _start_decoding(self, room: DecodeRoom, status) -> None:
        aux = worker_pb2.AuxRecord.FromString(status.aux)
        if aux.bootstrap_room != room.room:  # an index mix-up somewhere: never decode from wrong KV
            self._drop(room, TransferFailed(f"aux record for room {aux.bootstrap_room} arrived in room {room.room}"))
            return
        room.kv_ready_at = time.monotonic()
        del self.transfer[room.room]
        self.receiver.release(room.room)
        self._end_prefix_send(room)
        if status.seconds > 0:
            metrics.TRANSFER_SPEED.set(status.bytes_moved / status.seconds / 1e9)
            metrics.TRANSFER_LATENCY.observe(status.seconds * 1e3)
        room.req.prefill_cached_tokens = aux.cached_tokens
        first = SampledToken(aux.first_token, aux.logprob, [(t.token_id, t.logprob) for t in aux.top] or None)
        try:
            out = self.engine.start_decoding(room.req, first)
        except GrammarViolation as e:   # P is not trusted blindly: its token must fit the grammar
            self._drop(room, e)
            return
        room.emit(out)
        if out.finished:
            self.streams.pop(room.req.rid, None)
            metrics.REQUESTS.labels("success").inc()

    def _drop(self, room: DecodeRoom, error: BaseException | None, reason: str = "failed") -> None:
        """The one exit for a request that does not finish normally: free everything it holds."""
        req = room.req
        if room in self.prealloc:
            self.prealloc.remove(room)
        if self.loading.get(room.room) is room:
            del self.loading[room.room]   # P was not told yet; the release cancels the load
            self.sched.release(req)
            self.engine.forget(req.rid)
        elif self.transfer.get(room.room) is room:
            del self.transfer[room.room]
            # No write may land in these pages once they are reused: the receiver guarantees it
            # after abort() returns; P is told too so it stops computing and frees its side.
            self.receiver.abort(room.room)
            self.receiver.release(room.room)
            self._end_prefix_send(room)
            self.peers.send_abort(room, reason)
            self.sched.release(req)
            self.engine.forget(req.rid)
        else:
            self.engine.abort(req.rid)  # running / retracted: the engine frees it (no-op if unknown)
            self.engine.forget(req.rid)
        self.streams.pop(req.rid, None)
        metrics.REQUESTS.labels("cancelled" if error is None else "failed").inc()
        if error is not None:
            log.warning("request %s (room %d) failed: %s", req.rid, room.room, error)
            room.emit(error)

    def _export_metrics(self) -> None:
        metrics.QUEUE_LEN.labels("prealloc").set(len(self.prealloc))
        metrics.QUEUE_LEN.labels("transfer").set(len(self.transfer))
        stats = self.sched.stats()
        metrics.QUEUE_LEN.labels("running").set(stats.running)
        metrics.QUEUE_LEN.labels("waiting").set(stats.waiting + stats.prefilling)
        metrics.export_kv(stats)
        self._export_tiers()
        metrics.export_vllm_compatible(self.engine.cfg.model, self.load())

    def load(self) -> worker_pb2.WorkerLoad:
        stats = self.sched.stats()
        return worker_pb2.WorkerLoad(
            running=stats.running + len(self.transfer) + len(self.loading), waiting=len(self.prealloc) + stats.waiting,
            free_pages=stats.free_pages, total_pages=stats.total_pages, prefill_tokens=stats.prefill_tokens,
            step_cost=step_cost_to_pb(self.sched.cost),
        )
