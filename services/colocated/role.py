"""A co-located worker serves the public Generation API itself; the router relays to it."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import grpc

from tandem.engine.config import EngineConfig
from tandem.engine.engine import LLMEngine
from tandem.engine.errors import TandemError
from tandem.engine.outputs import RequestOutput
from tandem.services.common.convert import priority_from_pb, prompt_from_pb, sampling_from_pb
from tandem.services.common.grpc_errors import abort_with
from tandem.services.worker import metrics
from tandem.services.worker import trace as worker_trace
from tandem.services.worker.config import WorkerConfig
from tandem.services.worker.convert import output_to_pb, step_cost_to_pb
from tandem.services.worker.loop import EngineLoop
from tandem.services.worker.server import RoleParts, register_role
from tandem.v1 import generation_pb2, generation_pb2_grpc, worker_pb2

log = logging.getLogger(__name__)


class ColocatedWorker:
    """StepWorker around LLMEngine: outputs go to per-request callbacks."""

    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self.streams: dict[str, Callable[[RequestOutput | BaseException], None]] = {}
        self._export_tiers = metrics.kv_tier_exporter(engine)

    def add(self, prompt, params, rid: str, emit: Callable[[RequestOutput | BaseException], None],
            priority: int = 0, resume_ids=(), lora: str | None = None) -> None:
        self.engine.add_request(prompt, params, rid, priority, resume_ids, lora)
        self.streams[rid] = emit
        for evicted, err in self.engine.take_evicted():  # pushed out of the full queue by this one
            metrics.REQUESTS.labels("rejected").inc()
            self.streams.pop(evicted)(err)

    def cancel(self, rid: str) -> None:
        if self.streams.pop(rid, None) is not None:
            self.engine.abort(rid)
            metrics.REQUESTS.labels("cancelled").inc()

    def has_work(self) -> bool:
        return self.engine.has_work()

    def step(self) -> None:
        for out in self.engine.step():
            emit = self.streams.get(out.rid)
            if emit is not None:
                emit(out)
                if out.finished:
                    del self.streams[out.rid]
                    metrics.REQUESTS.labels("success").inc()

    def tick(self) -> None:
        stats = self.engine.scheduler.stats()
        metrics.QUEUE_LEN.labels("waiting").set(stats.waiting)
        metrics.QUEUE_LEN.labels("running").set(stats.running + stats.prefilling)
        metrics.export_kv(stats)
        metrics.export_vllm_compatible(self.engine.cfg.model, self.load())
        self._export_tiers()

    def polling(self) -> bool:
        return False

    def on_idle(self) -> None:
        metrics.idle_check(self.engine)

    def load(self) -> worker_pb2.WorkerLoad:
        stats = self.engine.scheduler.stats()
        return worker_pb2.WorkerLoad(running=stats.running + stats.prefilling, waiting=stats.waiting,
                                     free_pages=stats.free_pages, total_pages=stats.total_pages,
                                     prefill_tokens=stats.prefill_tokens,
                                     step_cost=step_cost_to_pb(self.engine.scheduler.cost))


class GenerationServicer(generation_pb2_grpc.GenerationServicer):
    def __init__(self, worker: ColocatedWorker, loop: EngineLoop, model_name: str):
        self.worker, self.loop, self.model_name = worker, loop, model_name

    async def Generate(self, request: generation_pb2.GenerateRequest, context: grpc.aio.ServicerContext):
        queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        engine = self.worker.engine
        rid = request.request_id or f"co-{id(queue):x}"
        trace = worker_trace.colocated_trace(context, request)   # None unless tracing is on
        error = "cancelled"
        try:
            params, priority = sampling_from_pb(request.sampling), priority_from_pb(request)
            await self.loop.call(lambda: self.worker.add(
                prompt_from_pb(request), params, rid, lambda out: self.loop.deliver(queue.put_nowait, out),
                priority, list(request.resume_ids), engine.lora_for(request.model)))
        except TandemError as e:
            await abort_with(context, e)
        finished = False
        try:
            while True:
                out = await queue.get()
                if isinstance(out, BaseException):  # turned away from the full queue
                    finished, error = True, str(out)
                    await abort_with(context, out)
                if trace is not None:
                    trace.output(out)
                yield output_to_pb(out, engine.tokenizer.convert_ids_to_tokens)
                if out.finished:
                    finished, error = True, None
                    return
        finally:
            if not finished:
                self.loop.post(lambda: self.worker.cancel(rid))
            if trace is not None:
                trace.finish(error)

    async def ListModels(self, request, context):
        engine = self.worker.engine
        return generation_pb2.ListModelsResponse(models=[generation_pb2.ModelInfo(
            id=self.model_name, max_context_len=engine.context_len, vocab_size=engine.model_config.vocab_size)])


@register_role("colocated")
def build(engine_cfg: EngineConfig, wcfg: WorkerConfig, aio_loop) -> RoleParts:
    engine = LLMEngine(engine_cfg)
    worker = ColocatedWorker(engine)

    def add_servicers(server, loop) -> None:
        generation_pb2_grpc.add_GenerationServicer_to_server(
            GenerationServicer(worker, loop, engine_cfg.model), server)

    return RoleParts(
        worker=worker, role_pb=worker_pb2.WORKER_ROLE_COLOCATED, service_names=["tandem.v1.Generation"],
        add_servicers=add_servicers, engine=engine, inflight=lambda: len(worker.streams),
        close=engine.close,   # after the engine loop stopped: finishes the KV tiers' disk writes
    )
