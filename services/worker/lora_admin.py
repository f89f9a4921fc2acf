"""LoraAdmin on a worker: load or unload an adapter at runtime, between two engine steps (the engine
thread runs the call), so no step sees the loaded set change under it. Refused unless the worker
runs with --enable-lora-runtime-updating. A malformed adapter is INVALID_ARGUMENT naming what is
wrong; an unknown one on unload NOT_FOUND; unloading one that requests in flight use is refused
(FAILED_PRECONDITION): the caller retries when they finished. Requests in flight are never touched.
`on_change` runs after a change (the worker announces its new load at once)."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

import grpc

from tandem.engine.errors import TandemError
from tandem.services.common.grpc_errors import abort, abort_with
from tandem.services.worker.loop import EngineLoop
from tandem.v1 import generation_pb2, generation_pb2_grpc

log = logging.getLogger(__name__)


class WorkerLoraAdmin(generation_pb2_grpc.LoraAdminServicer):
    def __init__(self, engine, loop: EngineLoop, worker_id: str,
                 on_change: Callable[[], Awaitable[None]] | None = None):
        self.engine, self.loop, self.worker_id = engine, loop, worker_id
        self.on_change = on_change

    async def LoadLoraAdapter(self, request: generation_pb2.LoadLoraAdapterRequest, context):
        await self._run(context, lambda: self.engine.load_lora(request.lora_name, request.lora_path),
                        f"loaded LoRA adapter {request.lora_name!r} from {request.lora_path}")
        return generation_pb2.LoraAdapterResponse(workers=[self.worker_id])

    async def UnloadLoraAdapter(self, request: generation_pb2.UnloadLoraAdapterRequest, context):
        await self._run(context, lambda: self.engine.unload_lora(request.lora_name),
                        f"unloaded LoRA adapter {request.lora_name!r}")
        return generation_pb2.LoraAdapterResponse(workers=[self.worker_id])

    async def _run(self, context, fn, done: str) -> None:
        if not self.engine.cfg.enable_lora_runtime_updating:
            await abort(context, grpc.StatusCode.PERMISSION_DENIED,
                        f"worker {self.worker_id}: runtime LoRA updating is off (--enable-lora-runtime-updating)")
        try:
            await self.loop.call(fn)
        except TandemError as e:
            await abort_with(context, e)
        log.info("worker %s %s", self.worker_id, done)
        if self.on_change is not None:
            await self.on_change()
