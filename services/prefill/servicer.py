"""gRPC edge of the prefill worker: PrefillWorker.Prefill (router) and Bootstrap (decode workers)."""

from __future__ import annotations

import asyncio
import logging

import grpc

from tandem.engine.errors import TandemError
from tandem.kvtransfer.base import KVSender, TransferError
from tandem.services.common import tracing
from tandem.services.common.convert import priority_from_pb, prompt_from_pb, sampling_from_pb
from tandem.services.common.grpc_errors import abort_with
from tandem.services.prefill.rooms import BootstrapInfo
from tandem.services.prefill.worker import PrefillWorker
from tandem.services.worker import metrics
from tandem.services.worker import trace as worker_trace
from tandem.services.worker.loop import EngineLoop
from tandem.v1 import worker_pb2, worker_pb2_grpc

log = logging.getLogger(__name__)


class PrefillServicer(worker_pb2_grpc.PrefillWorkerServicer):
    def __init__(self, worker: PrefillWorker, loop: EngineLoop):
        self.worker, self.loop = worker, loop

    async def Prefill(self, request: worker_pb2.PrefillRequest, context: grpc.aio.ServicerContext):
        done: asyncio.Future = asyncio.get_running_loop().create_future()

        def on_done(resp: worker_pb2.PrefillResponse | BaseException) -> None:  # engine thread
            self.loop.deliver(lambda: done.done() or done.set_result(resp))

        rid = f"{request.request_id}/{request.bootstrap_room:x}"  # unique per attempt (see decode)
        span = worker_trace.prefill_span(context, request)   # None unless tracing is on
        try:
            params, priority = sampling_from_pb(request.sampling), priority_from_pb(request)
            room = await self.loop.call(lambda: self.worker.add_prefill(
                request.bootstrap_room, rid, prompt_from_pb(request), params, on_done, priority,
                list(request.resume_ids), request.lora or None, request.reuse_decode_kv))
        except TandemError as e:
            await abort_with(context, e)
        try:
            resp = await done
            worker_trace.end_prefill(span, resp, self.worker.sender, room)
            if isinstance(resp, BaseException):  # turned away from the full waiting queue
                await abort_with(context, resp)
            resp.request_id = request.request_id
            return resp
        except asyncio.CancelledError:
            # The router cancelled (client gone, or decode failed): stop and free the room.
            tracing.end(span, error="cancelled")
            self.loop.post(lambda: self.worker.abort_request(rid, "cancelled by router"))
            raise


class BootstrapServicer(worker_pb2_grpc.BootstrapServicer):
    """`boot_epoch`: this process's instance id (WorkerInfo.boot_epoch). A Bootstrap that names another
    epoch was meant for an earlier instance of this worker at the same address (the room it refers to
    died with it): it is refused at once rather than left to time out."""

    def __init__(self, worker: PrefillWorker, loop: EngineLoop, sender: KVSender, boot_epoch: int = 0):
        self.worker, self.loop, self.sender = worker, loop, sender
        self.boot_epoch = boot_epoch
        self._peer_epochs: dict[str, int] = {}   # decode worker id -> the epoch its metadata came from

    async def Bootstrap(self, request: worker_pb2.BootstrapRequest, context: grpc.aio.ServicerContext):
        peer = request.decode_worker_id
        if request.prefill_boot_epoch and self.boot_epoch and request.prefill_boot_epoch != self.boot_epoch:
            return worker_pb2.BootstrapResponse(
                accepted=False, stale_epoch=True,
                error=f"stale prefill instance: room {request.bootstrap_room} was paired with boot epoch "
                      f"{request.prefill_boot_epoch:x}, this process is {self.boot_epoch:x} (it restarted)")
        if (request.decode_boot_epoch and not request.transfer_metadata
                and self._peer_epochs.get(peer, request.decode_boot_epoch) != request.decode_boot_epoch):
            # The decode worker restarted under the same id: what we hold describes its predecessor.
            return worker_pb2.BootstrapResponse(accepted=False, need_metadata=True)
        if request.transfer_metadata:
            try:
                # Connecting may open a socket or map shared memory: keep it off the event loop.
                await asyncio.to_thread(self.sender.connect, peer, request.transfer_metadata)
            except TransferError as e:
                return worker_pb2.BootstrapResponse(accepted=False, error=f"cannot reach decode worker {peer}: {e}")
            self._peer_epochs[peer] = request.decode_boot_epoch
            _report_transports(peer, self.sender.transports(peer))
        elif not self.sender.has_peer(peer):
            return worker_pb2.BootstrapResponse(accepted=False, need_metadata=True)
        if request.page_size and request.page_size != self.worker.page_size:
            return worker_pb2.BootstrapResponse(
                accepted=False, error=f"page size mismatch: decode {request.page_size}, prefill {self.worker.page_size}")
        info = BootstrapInfo(peer, list(request.dst_page_ids), request.decode_prefix_len, request.decode_grpc_addr,
                             request.lora_digest, request.decode_boot_epoch)
        try:
            await self.loop.call(lambda: self.worker.bootstrap(request.bootstrap_room, info))
        except TandemError as e:
            return worker_pb2.BootstrapResponse(accepted=False, error=str(e))
        return worker_pb2.BootstrapResponse(accepted=True)

    async def AbortRoom(self, request: worker_pb2.AbortRoomRequest, context: grpc.aio.ServicerContext):
        # The engine thread answers only once no write of the room can still land on the decode side.
        await self.loop.call(lambda: self.worker.abort_room(request.bootstrap_room, request.reason or "aborted by decode"))
        return worker_pb2.AbortRoomResponse(acked=True)


def _report_transports(peer: str, transports: list) -> None:
    """Log and export what UCX negotiated with a decode worker (nixl/ucx; other backends report none)."""
    if not transports:
        return
    log.info("KV transfer to %s uses %s", peer, ", ".join(f"{t.name}/{t.device}" for t in transports))
    for t in transports:
        metrics.UCX_TRANSPORT.labels(peer, t.name, "true" if t.rdma else "false").set(1)
