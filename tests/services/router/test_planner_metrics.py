"""What the router exports for the SLO planner (services/planner/observe.py), read through /metrics."""

from __future__ import annotations

import asyncio
import urllib.request

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tandem.services.common.registry import RedisRegistry
from tandem.services.router.config import RouterConfig
from tandem.services.router.metrics import RouterMetrics
from tandem.services.router.route_config import RouteConfig
from tandem.services.router.server import RouterServer
from tandem.v1 import generation_pb2, generation_pb2_grpc, worker_pb2
from tests.services.common.conftest import arun, wait_until
from tests.services.router.fakes import FakeDecode, FakePrefill

BASE = RouterConfig(port=0, metrics_port=0, drain_timeout_s=0.5, route=RouteConfig(local_prefill_max_tokens=-1))


def _samples(text: str) -> dict[tuple, float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def _req(ids, max_tokens=3):
    return generation_pb2.GenerateRequest(token_ids=generation_pb2.TokenIds(ids=ids),
                                          sampling=generation_pb2.SamplingParams(max_tokens=max_tokens))


def test_arrivals_lengths_itl_and_worker_loads_on_the_metrics_endpoint(redis_url):
    async def body():
        p, d = FakePrefill(), FakeDecode(tokens=(11, 12, 13))
        p_addr, d_addr = await p.start(), await d.start()
        step = worker_pb2.StepCost(base_s=0.02, per_decode_row_s=0.0, per_prefill_token_s=0.0004, steps=9)
        infos = [
            worker_pb2.WorkerInfo(worker_id="p0", role=worker_pb2.WORKER_ROLE_PREFILL, grpc_addr=p_addr,
                                  bootstrap_addr="p0-bootstrap:1", load=worker_pb2.WorkerLoad(
                                      running=1, waiting=2, free_pages=30, total_pages=40, prefill_tokens=700,
                                      step_cost=step)),
            worker_pb2.WorkerInfo(worker_id="d0", role=worker_pb2.WORKER_ROLE_DECODE, grpc_addr=d_addr,
                                  load=worker_pb2.WorkerLoad(running=5, free_pages=10, total_pages=40)),
        ]
        announced = []
        for info in infos:
            reg = RedisRegistry(redis_url, watch=False, ttl_s=2.0, heartbeat_s=0.1)
            await reg.start()
            await reg.announce(info)
            announced.append(reg)
        router = RouterServer(BASE, RedisRegistry(redis_url, poll_s=0.05))
        await router.start()
        channel = grpc.aio.insecure_channel(router.grpc_addr)
        stub = generation_pb2_grpc.GenerationStub(channel)
        try:
            await wait_until(router.can_route)
            for ids in ([1] * 10, [2] * 30):
                out = [m async for m in stub.Generate(_req(ids))]
                assert len(out) == 3
            with pytest.raises(grpc.aio.AioRpcError):   # rejected, but it arrived
                await stub.Generate(generation_pb2.GenerateRequest(text="")).read()

            url = f"http://127.0.0.1:{router.metrics_port}/metrics"
            got = _samples(await asyncio.to_thread(lambda: urllib.request.urlopen(url, timeout=5).read().decode()))
            assert got[("tandem_router_arrivals_total", ())] == 3
            assert got[("tandem_router_prompt_tokens_count", ())] == 2
            assert got[("tandem_router_prompt_tokens_sum", ())] == 40
            assert got[("tandem_router_output_tokens_sum", ())] == 6
            assert got[("tandem_router_itl_seconds_count", ())] == 4   # 3 one-token chunks: 2 gaps each
            assert got[("tandem_router_ttft_seconds_count", ())] == 2

            def worker(name, wid, role):
                return got[(f"tandem_router_worker_{name}", (("role", role), ("worker", wid)))]

            assert (worker("running", "p0", "prefill"), worker("waiting", "p0", "prefill")) == (1, 2)
            assert worker("prefill_tokens", "p0", "prefill") == 700
            assert worker("kv_usage", "p0", "prefill") == pytest.approx(0.25)
            assert worker("kv_usage", "d0", "decode") == pytest.approx(0.75)
            assert worker("step_base_seconds", "p0", "prefill") == pytest.approx(0.02)
            assert worker("step_prefill_token_seconds", "p0", "prefill") == pytest.approx(0.0004)
            assert ("tandem_router_worker_step_base_seconds", (("role", "decode"), ("worker", "d0"))) not in got
        finally:
            await channel.close()
            await router.stop(0)
            for reg in announced:
                await reg.close()
            await p.stop()
            await d.stop()

    arun(body())


def test_a_chunk_of_n_tokens_counts_n_gaps():
    m = RouterMetrics()
    m.observe_itl(0.09, 3)
    assert m.registry.get_sample_value("tandem_router_itl_seconds_count") == 3
    assert m.registry.get_sample_value("tandem_router_itl_seconds_sum") == pytest.approx(0.09)
    assert m.registry.get_sample_value("tandem_router_itl_seconds_bucket", {"le": "0.03"}) == 3

