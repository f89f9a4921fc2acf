"""--min-prefill-workers 0: a disaggregated router with no prefill worker registered serves every prompt
on its decode worker (the local route) and says it is SERVING; once a prefill worker registers, prompts
go to it again; when it leaves, local again. With the default (1) the router is not SERVING without one,
but a request that comes falls back to its decode worker's own prefill (--no-fallback: refused)."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import grpc
import pytest
from grpc_health.v1 import health_pb2

from tandem.services.common.registry import RedisRegistry
from tandem.services.router.config import RouterConfig
from tandem.services.router.route_config import RouteConfig
from tandem.v1 import worker_pb2
from tests.services.common.conftest import arun, wait_until
from tests.services.router.fakes import FakeDecode, FakePrefill
from tests.services.router.test_router import BASE, _collect, _metric, _req, cluster

SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING


def _long(t: int):
    req = _req()
    req.token_ids.ids.extend([t] * 200)   # never local by size: BASE has --local-prefill-max-tokens -1
    return req


async def _announce(redis_url: str, info: worker_pb2.WorkerInfo) -> RedisRegistry:
    reg = RedisRegistry(redis_url, watch=False, ttl_s=1.0, heartbeat_s=0.1)
    await reg.start()
    await reg.announce(info)
    return reg


def test_with_no_prefill_worker_the_decode_worker_prefills_and_the_router_serves(redis_url):
    async def body():
        p, d = FakePrefill(), FakeDecode(tokens=(5,))
        p_addr, d_addr = await p.start(), await d.start()
        config = replace(BASE, min_prefill_workers=0)
        async with cluster([], [], config, registry=RedisRegistry(redis_url, poll_s=0.05)) as (router, stub):
            assert not router.can_route()          # still needs a decode worker
            dreg = await _announce(redis_url, worker_pb2.WorkerInfo(
                worker_id="d0", role=worker_pb2.WORKER_ROLE_DECODE, grpc_addr=d_addr, model="tiny"))
            await wait_until(lambda: router.health._server_status[""] == SERVING)

            assert [t for m in await _collect(stub, _long(6)) for t in m.token_ids] == [5]
            assert d.requests[-1].local_prefill and not d.requests[-1].prefill_worker_id
            assert _metric(router, "tandem_router_prefill_route_total", route="local") == 1

            preg = await _announce(redis_url, worker_pb2.WorkerInfo(
                worker_id="p0", role=worker_pb2.WORKER_ROLE_PREFILL, grpc_addr=p_addr,
                bootstrap_addr="p0-bootstrap:1", model="tiny"))
            await wait_until(lambda: router.registry.workers(worker_pb2.WORKER_ROLE_PREFILL))
            await _collect(stub, _long(7))
            assert d.requests[-1].prefill_worker_id == "p0" and not d.requests[-1].local_prefill
            assert [list(r.token_ids.ids) for r in p.requests] == [[7] * 200]

            await preg.close()                     # the prefill worker leaves (a reshape to 0P1D)
            await wait_until(lambda: not router.registry.workers(worker_pb2.WORKER_ROLE_PREFILL))
            assert router.health._server_status[""] == SERVING
            await _collect(stub, _long(8))
            assert d.requests[-1].local_prefill and len(p.requests) == 1
            assert _metric(router, "tandem_router_prefill_route_total", route="local") == 2
            assert not router.servicer.planner.inflight and not router.servicer.planner.inflight_tokens

            await dreg.close()
            await wait_until(lambda: router.health._server_status[""] == NOT_SERVING)
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await _collect(stub, _long(9))
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE and "no decode workers" in info.value.details()
        await p.stop()
        await d.stop()

    arun(body())


def test_with_no_prefill_worker_the_decode_worker_prefills_unless_no_fallback(redis_url):
    """Decode-only fallback (the default): no prefill worker registered, the router still serves the
    prompt through its decode worker's local prefill, counted and bounded; --no-fallback fails fast."""
    async def body():
        d = FakeDecode(tokens=(5,))
        d_addr = await d.start()
        strict = replace(BASE, route=replace(BASE.route, fallback=False))
        async with cluster([], [], strict, registry=RedisRegistry(redis_url, poll_s=0.05)) as (router, stub):
            dreg = await _announce(redis_url, worker_pb2.WorkerInfo(
                worker_id="d0", role=worker_pb2.WORKER_ROLE_DECODE, grpc_addr=d_addr, model="tiny"))
            await wait_until(lambda: router.registry.workers(worker_pb2.WORKER_ROLE_DECODE))
            assert not router.can_route() and router.health._server_status[""] == NOT_SERVING
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await _collect(stub, _long(6))
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "no prefill workers are registered" in info.value.details()
            assert "--no-fallback" in info.value.details()
            assert not d.requests
            await dreg.close()

        bounded = replace(BASE, route=replace(BASE.route, fallback_local_prefill_max_tokens=100))
        async with cluster([], [], bounded, registry=RedisRegistry(redis_url, poll_s=0.05)) as (router, stub):
            dreg = await _announce(redis_url, worker_pb2.WorkerInfo(
                worker_id="d0", role=worker_pb2.WORKER_ROLE_DECODE, grpc_addr=d_addr, model="tiny"))
            await wait_until(lambda: router.registry.workers(worker_pb2.WORKER_ROLE_DECODE))
            short = _req()
            short.token_ids.ids.extend([3] * 50)
            assert [t for m in await _collect(stub, short) for t in m.token_ids] == [5]
            assert d.requests[-1].local_prefill and not d.requests[-1].prefill_worker_id
            assert _metric(router, "tandem_router_fallbacks_total", reason="no_prefill_worker") == 1
            with pytest.raises(grpc.aio.AioRpcError) as info:      # 200 tokens > 100
                await _collect(stub, _long(6))
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "--fallback-local-prefill-max-tokens 100" in info.value.details()
            assert len(d.requests) == 1
            assert not router.servicer.planner.inflight and not router.servicer.planner.inflight_tokens
            await dreg.close()
        await d.stop()

    arun(body())


def test_the_only_prefill_worker_failing_falls_back_to_the_decode_worker():
    """The only prefill worker answers UNAVAILABLE (dying, partitioned): the request is retried on its
    decode worker's own prefill instead of failing (Dynamo's decode-only fallback)."""
    async def body():
        p, d = FakePrefill(behaviour=grpc.StatusCode.UNAVAILABLE), FakeDecode(tokens=(7, 8), kv_delay_s=1.0)
        async with cluster([p], [d]) as (router, stub):
            assert [t for m in await _collect(stub, _long(6)) for t in m.token_ids] == [7, 8]
            assert d.requests[-1].local_prefill
            assert _metric(router, "tandem_router_fallbacks_total", reason="no_prefill_worker") == 1
            assert _metric(router, "tandem_router_retries_total") == 1
        strict = replace(BASE, route=replace(BASE.route, fallback=False))
        # D waits for the KV as a real one does (else, under load, its tokens may beat P's answer and
        # the stream is no longer the prefill's to fail: servicer.py relays them).
        p2, d2 = FakePrefill(behaviour=grpc.StatusCode.UNAVAILABLE), FakeDecode(tokens=(7, 8), kv_delay_s=1.0)
        async with cluster([p2], [d2], strict) as (router, stub):
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await _collect(stub, _long(6))
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE

    arun(body())


def test_the_flag_is_validated():
    with pytest.raises(ValueError, match="--min-prefill-workers must be >= 0"):
        replace(RouterConfig(redis_url="redis://x"), min_prefill_workers=-1).validate()
    with pytest.raises(ValueError, match="--fallback-local-prefill-max-tokens must be > 0 or -1"):
        RouteConfig(fallback_local_prefill_max_tokens=0).validate()


def test_a_prefill_failure_after_decode_streamed_does_not_break_the_stream():
    """D streamed a token, so the KV reached it: P's late UNAVAILABLE (it died after the hand-off) is a
    log line, not a retry that would send the client its tokens twice."""
    async def body():
        p = FakePrefill(behaviour=grpc.StatusCode.UNAVAILABLE, delay_s=0.3)
        d = FakeDecode(behaviour="stall", tokens=(7, 8))
        async with cluster([p], [d]) as (router, stub):
            collect = asyncio.ensure_future(_collect(stub, _long(6)))
            await asyncio.sleep(0.8)                      # P has failed meanwhile, D holds its 2nd token
            d.release.set()
            assert [t for m in await collect for t in m.token_ids] == [7, 8]
            assert len(d.requests) == 1 and not d.requests[0].local_prefill
            assert _metric(router, "tandem_router_retries_total") == 0

    arun(body())
