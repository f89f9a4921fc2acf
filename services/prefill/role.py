"""Assembles a prefill worker process: engine (prefill-only admission) + KV sender + servicers."""

from __future__ import annotations

import dataclasses

from tandem.engine.config import EngineConfig
from tandem.engine.engine import LLMEngine
from tandem.engine.kvcache.kv_pool import KVPoolSpec
from tandem.kvtransfer import create_receiver, create_sender
from tandem.kvtransfer.base import KVReceiver
from tandem.services.prefill.kv_fetch import KVFetcher
from tandem.services.prefill.servicer import BootstrapServicer, PrefillServicer
from tandem.services.prefill.worker import PrefillTimeouts, PrefillWorker
from tandem.services.worker.config import WorkerConfig
from tandem.services.worker.fault_sender import sender_options, wrap_sender
from tandem.services.worker.layout import layout_of
from tandem.services.worker.rdma import transfer_options
from tandem.services.worker.server import RoleParts, register_role
from tandem.v1 import worker_pb2, worker_pb2_grpc


@register_role("prefill")
def build(engine_cfg: EngineConfig, wcfg: WorkerConfig, aio_loop) -> RoleParts:
    # A prefill worker never decodes: admission reserves nothing for future tokens, no decode graphs
    # are captured, and speculation (a decode-path feature; `tandem up` passes the same flags to every
    # worker) stays off.
    cfg = dataclasses.replace(engine_cfg, init_new_token_ratio=0.0, min_new_token_ratio=0.0, enable_graph=False,
                              speculative_algorithm=None)
    holder: dict[str, KVReceiver] = {}

    def allocate(spec: KVPoolSpec):
        # KV both ways: the pool's memory is a receiver's, so that decode workers can write into it the
        # prompt pages they hold (kv_fetch.py); the sender below writes from the same memory.
        holder["rx"] = create_receiver(wcfg.transfer_backend, layout_of(spec), wcfg.public_host, wcfg.id,
                                       **transfer_options(wcfg, "receiver"))
        return holder["rx"].buffer

    engine = LLMEngine(cfg, kv_allocator=allocate if wcfg.kv_reuse else None)
    receiver = holder.get("rx")
    fetcher = None if receiver is None else KVFetcher(wcfg.id, receiver, cfg.page_size, wcfg.transfer_timeout_s,
                                                      wcfg.auth)
    sender = create_sender(wcfg.transfer_backend, engine.runner.pool.buffer, layout_of(engine.runner.pool.spec),
                           wcfg.id, **transfer_options(wcfg, "sender"), **sender_options(wcfg.faults, wcfg.id))
    sender = wrap_sender(sender, wcfg.faults, wcfg.id)
    worker = PrefillWorker(engine, sender, PrefillTimeouts(wcfg.bootstrap_timeout_s, wcfg.transfer_timeout_s),
                           max_rooms=wcfg.max_queue, stream_layers=wcfg.stream_layers, fetcher=fetcher)

    def add_servicers(server, loop) -> None:
        if fetcher is not None:
            fetcher.bind(loop)
        worker_pb2_grpc.add_PrefillWorkerServicer_to_server(PrefillServicer(worker, loop), server)
        worker_pb2_grpc.add_BootstrapServicer_to_server(
            BootstrapServicer(worker, loop, sender, boot_epoch=wcfg.boot_epoch), server)

    def close() -> None:
        # After the engine loop stopped: the engine (the KV tiers finish their disk writes), then the
        # transfer ends (the receiver owns the pool's memory: last).
        engine.close()
        sender.close()
        if receiver is not None:
            receiver.close()

    return RoleParts(
        worker=worker, role_pb=worker_pb2.WORKER_ROLE_PREFILL,
        service_names=["tandem.v1.PrefillWorker", "tandem.v1.Bootstrap"],
        add_servicers=add_servicers, engine=engine, transfer_backend=wcfg.transfer_backend,
        close=close, inflight=lambda: len(worker.rooms), outstanding=lambda: worker.outstanding_seen,
    )
