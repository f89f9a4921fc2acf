"""WorkerIdentity.GetWorkerInfo: what this worker would announce, with its current load.

Registries that see only addresses (Kubernetes endpoints) ask it once per new endpoint to learn the
worker's id, model, limits and boot epoch, and then poll it for load; the epoch tells a restarted
process at the same address (same pod) from its predecessor.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import grpc

from tandem.v1 import worker_pb2, worker_pb2_grpc


class WorkerIdentityServicer(worker_pb2_grpc.WorkerIdentityServicer):
    """`info` is set once the worker listens (its address depends on the bound port)."""

    def __init__(self, load: Callable[[], Awaitable[worker_pb2.WorkerLoad]]):
        self.info: worker_pb2.WorkerInfo | None = None
        self._load = load

    async def GetWorkerInfo(self, request: worker_pb2.WorkerInfoRequest, context: grpc.aio.ServicerContext):
        if self.info is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "worker is still starting")
        out = worker_pb2.WorkerInfo()
        out.CopyFrom(self.info)
        out.load.CopyFrom(await self._load())
        return out
