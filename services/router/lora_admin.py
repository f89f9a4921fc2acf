"""LoraAdmin on the router: a runtime adapter load or unload on every registered worker of the mode's
roles (each worker checks --enable-lora-runtime-updating and applies it between two of its steps).

Load: all or nothing. Every worker loads it; if one refuses (a malformed adapter: INVALID_ARGUMENT
naming what is wrong, a path it cannot read, ...) the workers that loaded it unload it again and the
caller gets that refusal. Unload: done once no worker knows the adapter any more: a worker that does
not know it (NOT_FOUND) counts as done, unless none knew it (NOT_FOUND to the caller); a worker where
requests still use it refuses (FAILED_PRECONDITION, which names it): the others have dropped it, and
a retry once those requests finished completes it. Afterwards the registry is re-read, so routing
and ListModels see the change at once (each worker announced its new load before answering).
"""

from __future__ import annotations

import asyncio
import logging

import grpc

from tandem.services.common.grpc_errors import PARAM_METADATA_KEY, abort
from tandem.services.common.registry import WorkerRegistry
from tandem.services.router.channels import ChannelPool
from tandem.v1 import generation_pb2, generation_pb2_grpc, worker_pb2

log = logging.getLogger(__name__)

ADMIN_TIMEOUT_S = 60.0
# Most telling first: what the caller must fix, then what they must wait for, then the rest.
_RANK = {grpc.StatusCode.INVALID_ARGUMENT: 0, grpc.StatusCode.PERMISSION_DENIED: 1,
         grpc.StatusCode.FAILED_PRECONDITION: 2, grpc.StatusCode.RESOURCE_EXHAUSTED: 3}


class RouterLoraAdmin(generation_pb2_grpc.LoraAdminServicer):
    def __init__(self, registry: WorkerRegistry, channels: ChannelPool, roles):
        self.registry, self.channels, self.roles = registry, channels, tuple(roles)

    async def LoadLoraAdapter(self, request: generation_pb2.LoadLoraAdapterRequest, context):
        workers = await self._workers(context)
        results = await self._each(workers, "LoadLoraAdapter", request)
        failed = [(w, e) for w, e in results if e is not None]
        if failed:
            loaded = [w for w, e in results if e is None]
            undo = generation_pb2.UnloadLoraAdapterRequest(lora_name=request.lora_name)
            await self._each(loaded, "UnloadLoraAdapter", undo)   # all or nothing
            await self._fail(context, failed)
        log.info("loaded LoRA adapter %r from %s on %d workers", request.lora_name, request.lora_path, len(workers))
        await self.registry.refresh()
        return generation_pb2.LoraAdapterResponse(workers=[w.worker_id for w in workers])

    async def UnloadLoraAdapter(self, request: generation_pb2.UnloadLoraAdapterRequest, context):
        workers = await self._workers(context)
        results = await self._each(workers, "UnloadLoraAdapter", request)
        await self.registry.refresh()
        done = [w for w, e in results if e is None]
        failed = [(w, e) for w, e in results if e is not None and e.code() != grpc.StatusCode.NOT_FOUND]
        if failed:
            await self._fail(context, failed)
        if not done:
            await abort(context, grpc.StatusCode.NOT_FOUND, f"no worker has a LoRA adapter {request.lora_name!r}",
                        [(PARAM_METADATA_KEY, "lora_name")])
        log.info("unloaded LoRA adapter %r on %d workers", request.lora_name, len(done))
        return generation_pb2.LoraAdapterResponse(workers=[w.worker_id for w in done])

    async def _workers(self, context) -> list[worker_pb2.WorkerInfo]:
        workers = [w for role in self.roles for w in self.registry.workers(role)]
        if not workers:
            await abort(context, grpc.StatusCode.UNAVAILABLE, "no workers are registered")
        return workers

    async def _each(self, workers, method: str, request) -> list[tuple[worker_pb2.WorkerInfo, grpc.aio.AioRpcError | None]]:
        async def one(w):
            stub = generation_pb2_grpc.LoraAdminStub(self.channels.get(w.grpc_addr))
            try:
                await getattr(stub, method)(request, timeout=ADMIN_TIMEOUT_S)
            except grpc.aio.AioRpcError as e:
                return w, e
            return w, None
        return list(await asyncio.gather(*(one(w) for w in workers)))

    @staticmethod
    async def _fail(context, failed) -> None:
        w, e = min(failed, key=lambda f: _RANK.get(f[1].code(), 9))
        code = e.code()
        if code == grpc.StatusCode.UNIMPLEMENTED:   # a worker without --enable-lora
            code, details = grpc.StatusCode.INVALID_ARGUMENT, "LoRA is off on this worker (--enable-lora)"
        else:
            details = e.details() or code.name
        trailing = [(k, v) for k, v in e.trailing_metadata() or () if k == PARAM_METADATA_KEY]
        await abort(context, code, f"worker {w.worker_id}: {details}", trailing)
