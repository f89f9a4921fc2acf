"""Assembles a decode worker process: KV receiver (owns the pool memory) + engine + servicers."""

from __future__ import annotations

from tandem.engine.config import EngineConfig
from tandem.engine.engine import LLMEngine
from tandem.engine.kvcache.kv_pool import KVPoolSpec
from tandem.kvtransfer import create_receiver, create_sender
from tandem.kvtransfer.base import KVReceiver
from tandem.services.decode.kv_source import KVSourceServicer
from tandem.services.decode.servicer import BootstrapClient, DecodeServicer
from tandem.services.decode.worker import DecodeTimeouts, DecodeWorker
from tandem.services.worker.config import WorkerConfig
from tandem.services.worker.layout import layout_of
from tandem.services.worker.rdma import transfer_options
from tandem.services.worker.server import RoleParts, register_role
from tandem.v1 import worker_pb2, worker_pb2_grpc


@register_role("decode")
def build(engine_cfg: EngineConfig, wcfg: WorkerConfig, aio_loop) -> RoleParts:
    holder: dict[str, KVReceiver] = {}

    def allocate(spec: KVPoolSpec):
        # The receiver owns the pool's memory so that writers (shm) can map it directly.
        holder["rx"] = create_receiver(wcfg.transfer_backend, layout_of(spec), wcfg.public_host, wcfg.id,
                                       **transfer_options(wcfg, "receiver"))
        return holder["rx"].buffer

    engine = LLMEngine(engine_cfg, kv_allocator=allocate)
    receiver = holder["rx"]
    peers = BootstrapClient(wcfg.id, receiver, wcfg.transfer_backend, timeout_s=wcfg.bootstrap_timeout_s,
                            boot_epoch=wcfg.boot_epoch, auth=wcfg.auth)
    worker = DecodeWorker(engine, receiver, DecodeTimeouts(wcfg.transfer_timeout_s), peers,
                          max_prealloc=engine_cfg.max_queued_requests)

    def make_sender():
        # KV both ways: this worker's pool (the receiver's memory) as a prefill worker's fetch source.
        return create_sender(wcfg.transfer_backend, receiver.buffer, layout_of(engine.runner.pool.spec), wcfg.id,
                             **transfer_options(wcfg, "sender"))

    def add_servicers(server, loop) -> None:
        peers.bind(loop, worker)
        worker_pb2_grpc.add_DecodeWorkerServicer_to_server(DecodeServicer(worker, loop), server)
        worker_pb2_grpc.add_KVSourceServicer_to_server(
            KVSourceServicer(worker, loop, make_sender if wcfg.kv_reuse else None), server)

    def close() -> None:
        engine.close()
        if worker.prefix_sender is not None:
            worker.prefix_sender.close()
        receiver.close()

    return RoleParts(
        worker=worker, role_pb=worker_pb2.WORKER_ROLE_DECODE,
        service_names=["tandem.v1.DecodeWorker", "tandem.v1.KVSource"],
        add_servicers=add_servicers, engine=engine, transfer_backend=wcfg.transfer_backend,
        # After the engine loop stopped: the engine first (the KV tiers finish their disk writes while
        # the pool the receiver owns is still mapped), then the transfer end.
        close=close, inflight=lambda: len(worker.streams),
        on_listening=lambda addr: setattr(peers, "grpc_addr", addr),
    )
