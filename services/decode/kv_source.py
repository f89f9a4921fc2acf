"""KV both ways, the decode worker's side: KVSource.SendPrefix sends a prefill worker the prompt pages
this worker holds (services/prefill/kv_fetch.py is the other side).

A decode worker's pool has a sender too, made at the first SendPrefix (over the same memory its
receiver owns, with the same backend and options as a prefill worker's). A call is honoured only for
a room bootstrapped here with that prefill worker and still waiting for its KV, and only for pages of
the prompt prefix its request holds locked (`DecodeWorker.send_prefix`); the writes are queued on the
engine thread and complete on P's receiver, checksummed. Refusals answer `accepted=false` with the
reason: P then computes those tokens.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable

import grpc

from tandem.engine.errors import TandemError
from tandem.kvtransfer.base import KVSender, TransferError
from tandem.services.decode.worker import DecodeWorker
from tandem.services.worker import metrics
from tandem.services.worker.loop import EngineLoop
from tandem.v1 import worker_pb2, worker_pb2_grpc

log = logging.getLogger(__name__)


class KVSourceServicer(worker_pb2_grpc.KVSourceServicer):
    """`make_sender`: builds this worker's KV sender over its pool (called once, off the event loop);
    None: this worker does not send (--no-kv-reuse-from-decode), every call is refused."""

    def __init__(self, worker: DecodeWorker, loop: EngineLoop, make_sender: Callable[[], KVSender] | None):
        self.worker, self.loop = worker, loop
        self._make_sender = make_sender
        self._lock = threading.Lock()

    def _sender(self) -> KVSender:
        with self._lock:
            if self.worker.prefix_sender is None:
                self.worker.prefix_sender = self._make_sender()
            return self.worker.prefix_sender

    async def SendPrefix(self, request: worker_pb2.SendPrefixRequest, context: grpc.aio.ServicerContext):
        peer = request.prefill_worker_id
        if self._make_sender is None:
            return self._refuse("this decode worker does not send KV (--no-kv-reuse-from-decode)")
        try:
            sender = await asyncio.to_thread(self._sender)
            # Connecting may open a socket or map shared memory: off the event loop. Idempotent per metadata.
            await asyncio.to_thread(sender.connect, peer, request.transfer_metadata)
        except TransferError as e:
            return self._refuse(f"cannot reach prefill worker {peer}: {e}")
        try:
            await self.loop.call(lambda: self.worker.send_prefix(
                request.bootstrap_room, peer, request.first_page, list(request.dst_page_ids)))
        except (TandemError, TransferError, ValueError) as e:   # ValueError: P's page ids out of range
            return self._refuse(str(e))
        metrics.KV_PREFIX_SENDS.labels("accepted").inc()
        return worker_pb2.SendPrefixResponse(accepted=True)

    @staticmethod
    def _refuse(error: str) -> worker_pb2.SendPrefixResponse:
        log.info("SendPrefix refused: %s", error)
        metrics.KV_PREFIX_SENDS.labels("refused").inc()
        return worker_pb2.SendPrefixResponse(accepted=False, error=error)
