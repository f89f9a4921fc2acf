"""gRPC edge of the prefill worker: PrefillWorker.Prefill (router) and Bootstrap (decode workers)."""

from __future__ import annotations

import asyncio
import logging

import grpc

from engine.errors import TandemError
from kvtransfer.base import KVSender, TransferError
from services.common.convert import prompt_from_pb, sampling_from_pb
from services.common.grpc_errors import abort_with
from services.prefill.rooms import BootstrapInfo
from services.prefill.worker import PrefillWorker
from services.worker.loop import EngineLoop
from tandem.v1 import worker_pb2, worker_pb2_grpc

log = logging.getLogger(__name__)


class PrefillServicer(worker_pb2_grpc.PrefillWorkerServicer):
    def __init__(self, worker: PrefillWorker, loop: EngineLoop):
        self.worker, self.loop = worker, loop

    async def Prefill(self, request: worker_pb2.PrefillRequest, context: grpc.aio.ServicerContext):
        done: asyncio.Future = asyncio.get_running_loop().create_future()

        def on_done(resp: worker_pb2.PrefillResponse) -> None:  # engine thread
            self.loop.deliver(lambda: done.done() or done.set_result(resp))

        rid = f"{request.request_id}/{request.bootstrap_room:x}"  # unique per attempt (see decode)
        try:
            params = sampling_from_pb(request.sampling)
            await self.loop.call(lambda: self.worker.add_prefill(
                request.bootstrap_room, rid, prompt_from_pb(request), params, on_done))
        except TandemError as e:
            await abort_with(context, e)
        try:
            resp = await done
            resp.request_id = request.request_id
            return resp
        except asyncio.CancelledError:
            # The router cancelled (client gone, or decode failed): stop and free the room.
            self.loop.post(lambda: self.worker.abort_request(rid, "cancelled by router"))
            raise


class BootstrapServicer(worker_pb2_grpc.BootstrapServicer):
    def __init__(self, worker: PrefillWorker, loop: EngineLoop, sender: KVSender):
        self.worker, self.loop, self.sender = worker, loop, sender

    async def Bootstrap(self, request: worker_pb2.BootstrapRequest, context: grpc.aio.ServicerContext):
        peer = request.decode_worker_id
        if request.transfer_metadata:
            try:
                # Connecting may open a socket or map shared memory: keep it off the event loop.
                await asyncio.to_thread(self.sender.connect, peer, request.transfer_metadata)
            except TransferError as e:
                return worker_pb2.BootstrapResponse(accepted=False, error=f"cannot reach decode worker {peer}: {e}")
        elif not self.sender.has_peer(peer):
            return worker_pb2.BootstrapResponse(accepted=False, need_metadata=True)
        if request.page_size and request.page_size != self.worker.page_size:
            return worker_pb2.BootstrapResponse(
                accepted=False, error=f"page size mismatch: decode {request.page_size}, prefill {self.worker.page_size}")
        info = BootstrapInfo(peer, list(request.dst_page_ids), request.decode_prefix_len)
        try:
            await self.loop.call(lambda: self.worker.bootstrap(request.bootstrap_room, info))
        except TandemError as e:
            return worker_pb2.BootstrapResponse(accepted=False, error=str(e))
        return worker_pb2.BootstrapResponse(accepted=True)

    async def AbortRoom(self, request: worker_pb2.AbortRoomRequest, context: grpc.aio.ServicerContext):
        # The engine thread answers only once no write of the room can still land on the decode side.
        await self.loop.call(lambda: self.worker.abort_room(request.bootstrap_room, request.reason or "aborted by decode"))
        return worker_pb2.AbortRoomResponse(acked=True)
