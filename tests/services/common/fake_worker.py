"""A worker's identity service on loopback: what the Kubernetes and static registries ask a worker."""

from __future__ import annotations

import grpc

from tandem.services.common import keepalive
from tandem.services.worker.identity import WorkerIdentityServicer
from tandem.v1 import worker_pb2, worker_pb2_grpc

PREFILL = worker_pb2.WORKER_ROLE_PREFILL


class FakeWorker:
    """A worker's identity service on `ip:port` (what the registry asks every endpoint)."""

    def __init__(self, ip: str, port: int, role: int, name: str, uid: str, epoch: int):
        self.addr = f"{ip}:{port}"
        self.info = worker_pb2.WorkerInfo(worker_id=name, role=role, grpc_addr=self.addr, model="tiny",
                                          pod_uid=uid, boot_epoch=epoch, max_context_len=256,
                                          bootstrap_addr=self.addr if role == PREFILL else "")
        self.running = 0
        self.server: grpc.aio.Server | None = None

    async def start(self) -> FakeWorker:
        async def load():
            return worker_pb2.WorkerLoad(running=self.running, total_pages=8, free_pages=8)

        svc = WorkerIdentityServicer(load)
        svc.info = self.info
        self.server = grpc.aio.server(options=keepalive.SERVER_OPTIONS)  # as the real workers'
        worker_pb2_grpc.add_WorkerIdentityServicer_to_server(svc, self.server)
        assert self.server.add_insecure_port(self.addr), f"cannot bind {self.addr}"
        await self.server.start()
        return self

    async def stop(self) -> None:
        await self.server.stop(0)
