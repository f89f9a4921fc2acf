"""gRPC edge of the decode worker: DecodeWorker.Decode streams tokens; Bootstrap calls go out to P."""

from __future__ import annotations

import asyncio
import logging

import grpc

from tandem.engine.errors import TandemError
from tandem.engine.outputs import RequestOutput
from tandem.kvtransfer.base import KVReceiver
from tandem.services.common import tracing
from tandem.services.common.auth import InternalAuth
from tandem.services.common.convert import priority_from_pb, prompt_from_pb, sampling_from_pb
from tandem.services.common.grpc_errors import abort_with
from tandem.services.decode.worker import DecodeRoom, DecodeWorker
from tandem.services.worker import trace as worker_trace
from tandem.services.worker.convert import output_to_pb
from tandem.services.worker.loop import EngineLoop
from tandem.v1 import worker_pb2, worker_pb2_grpc

log = logging.getLogger(__name__)


class DecodeServicer(worker_pb2_grpc.DecodeWorkerServicer):
    def __init__(self, worker: DecodeWorker, loop: EngineLoop):
        self.worker, self.loop = worker, loop

    async def Decode(self, request: worker_pb2.DecodeRequest, context: grpc.aio.ServicerContext):
        queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        engine = self.worker.engine
        # One request id may arrive twice (the router retries on another pair before the first
        # token, while this worker may still be tearing down the first attempt): key by attempt.
        rid = f"{request.request_id}/{request.bootstrap_room:x}"
        trace = worker_trace.decode_trace(context, request)   # None unless tracing is on
        error = "cancelled"

        def emit(item) -> None:  # engine thread
            self.loop.deliver(queue.put_nowait, item)

        def add() -> None:
            req = engine.make_request(prompt_from_pb(request), sampling_from_pb(request.sampling), rid,
                                      priority_from_pb(request), list(request.resume_ids), request.lora or None)
            room = DecodeRoom(request.bootstrap_room, req, request.prefill_bootstrap_addr,
                              request.prefill_worker_id, emit, prefill_epoch=request.prefill_boot_epoch)
            if trace is not None:
                trace.room = room
            if request.local_prefill:
                self.worker.add_local(room)
            else:
                self.worker.add(room)

        try:
            await self.loop.call(add)
        except TandemError as e:
            await abort_with(context, e)
        finished = False
        try:
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    finished, error = True, str(item)
                    await abort_with(context, item)
                resp = output_to_pb(item, engine.tokenizer.convert_ids_to_tokens)
                resp.request_id = request.request_id
                if trace is not None:
                    trace.output(item)
                yield resp
                if item.finished:
                    finished, error = True, None
                    return
        finally:
            if not finished:  # cancelled by the router (client gone) or the stream broke
                self.loop.post(lambda: self.worker.cancel(rid))
            if trace is not None:
                trace.finish(error)


class BootstrapClient:
    """Sends D's Bootstrap / AbortRoom to prefill workers; one channel per prefill address.

    D's transfer metadata goes with the first Bootstrap to each prefill worker, and again whenever
    P says it lacks it (P restarted). Each Bootstrap names the prefill instance (boot epoch) the router
    paired, and this worker's own epoch."""

    def __init__(self, worker_id: str, receiver: KVReceiver, backend: str, timeout_s: float = 10.0,
                 boot_epoch: int = 0, auth: InternalAuth = InternalAuth()):
        self.auth = auth
        self.loop: EngineLoop | None = None
        self.worker_id = worker_id
        self.grpc_addr = ""               # set once the server listens (RoleParts.on_listening)
        self.boot_epoch = boot_epoch
        self.receiver = receiver
        self.backend = backend
        self.timeout_s = timeout_s
        self.worker: DecodeWorker | None = None
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._told: set[str] = set()
        self._tasks: set[asyncio.Task] = set()

    def bind(self, loop: EngineLoop, worker: DecodeWorker) -> None:
        """Attach the engine loop and the worker once the process's server is being assembled."""
        self.loop, self.worker = loop, worker

    def _stub(self, addr: str) -> worker_pb2_grpc.BootstrapStub:
        ch = self._channels.get(addr)
        if ch is None:
            ch = self._channels[addr] = self.auth.channel(addr)
        return worker_pb2_grpc.BootstrapStub(ch)

    # Called on the engine thread: hop to the event loop.
    def send_bootstrap(self, room: DecodeRoom, req: worker_pb2.BootstrapRequest) -> None:
        self.loop.deliver(self._spawn, self._bootstrap(room, req))

    def send_abort(self, room: DecodeRoom, reason: str) -> None:
        self.loop.deliver(self._spawn, self._abort(room, reason))

    def _spawn(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _bootstrap(self, room: DecodeRoom, req: worker_pb2.BootstrapRequest) -> None:
        req.decode_worker_id = self.worker_id
        req.transfer_backend = self.backend
        req.prefill_boot_epoch = room.prefill_epoch
        req.decode_boot_epoch = self.boot_epoch
        req.decode_grpc_addr = self.grpc_addr
        error = None
        span = worker_trace.bootstrap_span(room.room)
        try:
            stub = self._stub(room.prefill_addr)
            for _ in range(2):
                if room.prefill_id not in self._told:
                    req.transfer_metadata = self.receiver.metadata()
                resp = await stub.Bootstrap(req, timeout=self.timeout_s, metadata=tracing.outgoing(span))
                if resp.need_metadata:
                    self._told.discard(room.prefill_id)
                    continue
                if resp.accepted:
                    self._told.add(room.prefill_id)
                else:
                    error = resp.error
                break
            else:
                error = "prefill worker kept asking for transfer metadata"
        except grpc.aio.AioRpcError as e:
            error = f"{e.code().name}: {e.details()}"
        tracing.end(span, {"tandem.prefill_worker": room.prefill_id}, error=error)
        self.loop.post(lambda: self.worker.bootstrap_done(room.room, error))

    async def _abort(self, room: DecodeRoom, reason: str) -> None:
        try:
            await self._stub(room.prefill_addr).AbortRoom(
                worker_pb2.AbortRoomRequest(bootstrap_room=room.room, reason=reason), timeout=self.timeout_s)
        except grpc.aio.AioRpcError as e:  # P may be gone; its side then holds nothing of ours
            log.info("abort of room %d on %s: %s", room.room, room.prefill_addr, e.code().name)

    async def close(self) -> None:
        for ch in self._channels.values():
            await ch.close()
