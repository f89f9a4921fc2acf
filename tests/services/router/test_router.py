"""The router's Generate / ListModels / health end to end, against fake workers on 127.0.0.1."""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import replace

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tandem.services.common.registry import RedisRegistry, StaticRegistry
from tandem.services.router.config import RouterConfig
from tandem.services.router.route_config import RouteConfig
from tandem.services.router.server import RouterServer
from tandem.v1 import generation_pb2, generation_pb2_grpc, worker_pb2
from tests.services.common.conftest import arun, wait_until
from tests.services.router.fakes import FakeColocated, FakeDecode, FakePrefill, dead_addr

S = grpc.StatusCode
# These tests exercise the prefill-worker path: no prompt is prefilled on the decode worker by size.
BASE = RouterConfig(port=0, drain_timeout_s=0.5, route=RouteConfig(local_prefill_max_tokens=-1))


def _req(text="hello", max_tokens=3, **kw) -> generation_pb2.GenerateRequest:
    return generation_pb2.GenerateRequest(
        text=text, sampling=generation_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0), **kw
    )


@contextlib.asynccontextmanager
async def cluster(prefills, decodes, config=BASE, static_kw=None, registry=None):
    """Start fakes, a router over a static registry of their addresses, and a client stub."""
    addrs = {}
    for fake in (*prefills, *decodes):
        addrs[id(fake)] = fake if isinstance(fake, str) else await fake.start()
    if registry is None:
        registry = StaticRegistry(
            prefill=[addrs[id(f)] for f in prefills], decode=[addrs[id(f)] for f in decodes],
            probe_s=0, **(static_kw or {}),
        )
    router = RouterServer(config, registry)
    await router.start()
    channel = grpc.aio.insecure_channel(router.grpc_addr)
    try:
        yield router, generation_pb2_grpc.GenerationStub(channel)
    finally:
        await channel.close()
        await router.stop(0)
        for fake in (*prefills, *decodes):
            if not isinstance(fake, str):
                await fake.stop()


async def _collect(stub, req):
    return [m async for m in stub.Generate(req)]


def _metric(router, name, **labels):
    return router.metrics.registry.get_sample_value(name, labels)


def test_happy_path_relays_the_decode_stream():
    async def body():
        p, d = FakePrefill(), FakeDecode(tokens=(11, 12, 13))
        async with cluster([p], [d]) as (router, stub):
            out = await _collect(stub, _req("hello", max_tokens=3))
            assert [t for m in out for t in m.token_ids] == [11, 12, 13]
            assert out[-1].finish_reason == generation_pb2.FINISH_REASON_LENGTH
            [preq], [dreq] = p.requests, d.requests
            rid = out[0].request_id
            assert rid and preq.request_id == dreq.request_id == rid
            assert preq.bootstrap_room == dreq.bootstrap_room and 0 <= preq.bootstrap_room < 2**63
            assert (preq.text, dreq.text) == ("hello", "hello")
            assert dreq.prefill_bootstrap_addr == p.addr and dreq.prefill_worker_id == p.addr
            assert preq.sampling.max_tokens == dreq.sampling.max_tokens == 3

            # Token-id prompts and a caller-chosen request id pass through; each request gets a new room.
            req = generation_pb2.GenerateRequest(
                request_id="mine", token_ids=generation_pb2.TokenIds(ids=[5, 6]),
                sampling=generation_pb2.SamplingParams(max_tokens=2),
            )
            out = await _collect(stub, req)
            assert out[0].request_id == "mine" and list(p.requests[1].token_ids.ids) == [5, 6]
            assert list(d.requests[1].token_ids.ids) == [5, 6]
            assert p.requests[1].bootstrap_room != preq.bootstrap_room

            assert _metric(router, "tandem_router_requests_total", status="ok") == 2
            assert _metric(router, "tandem_router_ttft_seconds_count") == 2
            assert _metric(router, "tandem_router_inflight_requests") == 0
            assert _metric(router, "tandem_router_workers", role="prefill") == 1

    arun(body())


@pytest.mark.parametrize(("behaviour", "code"), [("failed", S.UNAVAILABLE), (S.INTERNAL, S.INTERNAL)])
def test_prefill_failure_cancels_decode_and_names_the_stage(behaviour, code):
    async def body():
        p, d = FakePrefill(behaviour, error="transfer timed out"), FakeDecode("hang")
        p.after = d.received  # fail while the decode call is in flight, as a real room failure would
        # --no-fallback: the failure reaches the client (the fallback is test_min_prefill.py's).
        strict = replace(BASE, route=replace(BASE.route, fallback=False))
        async with cluster([p], [d], strict) as (router, stub):
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await _collect(stub, _req())
            assert info.value.code() == code
            assert "prefill worker" in info.value.details() and "transfer timed out" in info.value.details()
            await asyncio.wait_for(d.cancelled.wait(), 2)
            assert _metric(router, "tandem_router_requests_total", status=code.name.lower()) == 1

    arun(body())


def test_decode_invalid_argument_propagates_and_cancels_prefill():
    async def body():
        p = FakePrefill("hang")
        d = FakeDecode(S.INVALID_ARGUMENT, error="prompt is longer than the context (9000 > 8192)", param="prompt")
        d.after = p.received
        async with cluster([p], [d]) as (_, stub):
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await _collect(stub, _req())
            assert info.value.code() == S.INVALID_ARGUMENT
            assert info.value.details() == "prompt is longer than the context (9000 > 8192)"
            assert ("tandem-error-param", "prompt") in tuple(info.value.trailing_metadata())
            await asyncio.wait_for(p.cancelled.wait(), 2)

    arun(body())


def test_client_cancel_cancels_both_calls():
    async def body():
        p, d = FakePrefill("hang"), FakeDecode("stall")
        async with cluster([p], [d]) as (router, stub):
            call = stub.Generate(_req())
            first = await call.read()
            assert list(first.token_ids) == [11]
            call.cancel()
            await asyncio.wait_for(asyncio.gather(p.cancelled.wait(), d.cancelled.wait()), 2)
            await wait_until(lambda: router.servicer.inflight == 0)
            assert not router.servicer.planner.inflight

    arun(body())


def test_unavailable_decode_before_first_token_retries_on_another_pair():
    async def body():
        p0, p1 = FakePrefill("hang"), FakePrefill()
        d0, d1 = FakeDecode(S.UNAVAILABLE, error="worker is shutting down"), FakeDecode(tokens=(7, 8))
        d0.after = p0.received
        async with cluster([p0, p1], [d0, d1]) as (router, stub):
            out = await _collect(stub, _req())
            assert [t for m in out for t in m.token_ids] == [7, 8]
            await asyncio.wait_for(p0.cancelled.wait(), 2)  # the first pair's prefill was cancelled
            assert len(p1.requests) == 1 and len(d1.requests) == 1
            assert d1.requests[0].prefill_bootstrap_addr == p1.addr
            assert p1.requests[0].bootstrap_room != p0.requests[0].bootstrap_room
            assert _metric(router, "tandem_router_retries_total") == 1

    arun(body())


def test_unreachable_decode_is_retried():
    async def body():
        p0, p1, d1 = FakePrefill("hang"), FakePrefill(), FakeDecode(tokens=(7,))
        async with cluster([p0, p1], [dead_addr(), d1]) as (router, stub):
            out = await _collect(stub, _req())
            assert [t for m in out for t in m.token_ids] == [7]
            assert len(d1.requests) == 1 and d1.requests[0].prefill_worker_id == p1.addr
            assert _metric(router, "tandem_router_retries_total") == 1

    arun(body())


def test_unavailable_prefill_retries_with_other_prefill():
    async def body():
        d0, p1, d1 = FakeDecode("hang"), FakePrefill(), FakeDecode(tokens=(9,))
        async with cluster([dead_addr(), p1], [d0, d1]) as (_, stub):
            out = await _collect(stub, _req())
            assert [t for m in out for t in m.token_ids] == [9]
            # The dead prefill fails at once, so the decode call may be cancelled before it reaches d0.
            await asyncio.sleep(0.1)
            assert d0.requests == [] or d0.cancelled.is_set()
            assert len(p1.requests) == len(d1.requests) == 1

    arun(body())


def test_unavailable_with_no_other_worker_fails_with_the_worker_error():
    async def body():
        p = FakePrefill("hang")
        dead = dead_addr()
        async with cluster([p], [dead]) as (router, stub):
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await _collect(stub, _req())
            assert info.value.code() == S.UNAVAILABLE
            assert f"decode worker {dead}" in info.value.details()
            assert _metric(router, "tandem_router_retries_total") == 0  # nothing else to retry on
            assert len(p.requests) <= 1

    arun(body())


def test_no_retry_after_the_first_token_without_migrations():
    async def body():
        # d0 streams one token and then dies with UNAVAILABLE; with --max-migrations 0 d1 must never
        # be called (migration: test_migration.py).
        class Dropping(FakeDecode):
            async def _decode(self, request, context):
                await context.write(generation_pb2.GenerateResponse(request_id=request.request_id, token_ids=[1]))
                await context.abort(S.UNAVAILABLE, "worker shutting down")

        p0, p1, d0, d1 = FakePrefill(), FakePrefill(), Dropping(), FakeDecode()
        async with cluster([p0, p1], [d0, d1], config=replace(BASE, max_migrations=0)) as (_, stub):
            call = stub.Generate(_req())
            assert list((await call.read()).token_ids) == [1]
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await call.read()
            assert info.value.code() == S.UNAVAILABLE
            assert "worker shutting down" in info.value.details()
            assert "broke after 1 tokens and was not continued: --max-migrations 0 reached" in info.value.details()
            assert d1.requests == []

    arun(body())


def test_max_inflight_answers_resource_exhausted_at_once():
    async def body():
        p, d = FakePrefill("hang"), FakeDecode("hang")
        async with cluster([p], [d], config=replace(BASE, max_inflight=1)) as (router, stub):
            first = stub.Generate(_req())
            await wait_until(lambda: d.requests)
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await _collect(stub, _req())
            assert info.value.code() == S.RESOURCE_EXHAUSTED
            assert "--max-inflight 1" in info.value.details()
            assert len(d.requests) == 1
            p.release.set()
            d.release.set()
            assert len([m async for m in first]) == 3  # the first request was untouched
            assert _metric(router, "tandem_router_requests_total", status="resource_exhausted") == 1

    arun(body())


def test_router_queue_serves_by_priority_and_turns_away_the_lowest():
    async def body():
        p, d = FakePrefill("hang"), FakeDecode("hang")
        config = replace(BASE, max_inflight=1, max_queued_requests=1, enable_priority_scheduling=True)
        async with cluster([p], [d], config=config) as (router, stub):
            first = stub.Generate(_req())
            await wait_until(lambda: d.requests)
            low = asyncio.ensure_future(_collect(stub, _req(priority=1)))
            await asyncio.sleep(0.2)
            high = asyncio.ensure_future(_collect(stub, _req(priority=2)))
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await low
            assert info.value.code() == S.RESOURCE_EXHAUSTED
            assert "router queue" in info.value.details() and "higher priority (2)" in info.value.details()
            assert [r.priority for r in d.requests] == [0]  # nothing else was disturbed
            p.release.set()
            d.release.set()
            assert len([m async for m in first]) == 3 and len(await high) == 3
            assert [r.priority for r in d.requests] == [0, 2] and [r.priority for r in p.requests] == [0, 2]
            assert router.servicer.inflight == 0

    arun(body())


def test_a_waiter_that_cannot_start_in_time_is_shed_with_resource_exhausted():
    async def body():
        p, d = FakePrefill("hang"), FakeDecode("hang")
        config = replace(BASE, max_inflight=1, max_queued_requests=4, queue_timeout_s=0.3)
        async with cluster([p], [d], config=config) as (router, stub):
            first = stub.Generate(_req())
            await wait_until(lambda: d.requests)
            t0 = time.monotonic()
            second = asyncio.ensure_future(_collect(stub, _req()))
            await wait_until(lambda: _metric(router, "tandem_router_queued_requests") == 1)
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await second
            assert info.value.code() == S.RESOURCE_EXHAUSTED and time.monotonic() - t0 < 3.0
            assert "shed from the router queue" in info.value.details()
            assert "--queue-timeout-secs 0.3" in info.value.details()
            assert _metric(router, "tandem_router_requests_total", status="resource_exhausted") == 1
            assert _metric(router, "tandem_router_shed_requests_total") == 1
            assert _metric(router, "tandem_router_queued_requests") == 0
            p.release.set()
            d.release.set()
            assert len([m async for m in first]) == 3 and router.servicer.inflight == 0
            assert not router.servicer.admission.queue

    arun(body())


def test_out_of_range_priority_is_invalid_argument():
    async def body():
        async with cluster([FakePrefill()], [FakeDecode()]) as (router, stub):
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await _collect(stub, _req(priority=1 << 31))
            assert info.value.code() == S.INVALID_ARGUMENT and "priority must be in" in info.value.details()

    arun(body())


def test_invalid_requests_are_rejected_before_any_worker_is_called():
    async def body():
        p, d = FakePrefill(), FakeDecode()
        async with cluster([p], [d]) as (_, stub):
            for req, param in [
                (_req(max_tokens=0), "max_tokens"),
                (generation_pb2.GenerateRequest(sampling=generation_pb2.SamplingParams(max_tokens=1)), "prompt"),
                (_req(text=""), "prompt"),
            ]:
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await _collect(stub, req)
                assert info.value.code() == S.INVALID_ARGUMENT
                assert ("tandem-error-param", param) in tuple(info.value.trailing_metadata())
            for field, value in (("top_p", 1.5), ("temperature", 2.5)):
                bad = _req()
                setattr(bad.sampling, field, value)
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await _collect(stub, bad)
                assert info.value.code() == S.INVALID_ARGUMENT and field in info.value.details()
                assert ("tandem-error-param", field) in tuple(info.value.trailing_metadata())
            assert p.requests == [] and d.requests == []

    arun(body())


def test_model_filter_and_list_models():
    async def body():
        p, d = FakePrefill(), FakeDecode()
        async with cluster([p], [d], static_kw={"model": "tiny"}) as (_, stub):
            resp = await stub.ListModels(generation_pb2.ListModelsRequest())
            assert [m.id for m in resp.models] == ["tiny"]
            assert len(await _collect(stub, _req(model="tiny"))) == 3
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await _collect(stub, _req(model="other"))
            assert info.value.code() == S.NOT_FOUND and "tiny" in info.value.details()

    arun(body())


def test_colocated_mode_relays_generate():
    async def body():
        w = FakeColocated(tokens=(31, 32))
        addr = await w.start()
        registry = StaticRegistry(colocated=[addr], probe_s=0)
        async with cluster([], [], config=replace(BASE, mode="colocated"), registry=registry) as (_, stub):
            out = await _collect(stub, _req(request_id="r1"))
            assert [t for m in out for t in m.token_ids] == [31, 32]
            assert w.requests[0].request_id == "r1" and w.requests[0].text == "hello"
        await w.stop()

    arun(body())


def test_health_follows_the_registry(redis_url):
    async def body():
        p, d = FakePrefill(), FakeDecode(tokens=(5,))
        p_addr, d_addr = await p.start(), await d.start()
        registry = RedisRegistry(redis_url, poll_s=0.05)
        async with cluster([], [], registry=registry) as (router, stub):
            channel = grpc.aio.insecure_channel(router.grpc_addr)
            health = health_pb2_grpc.HealthStub(channel)

            async def status(service=""):
                req = health_pb2.HealthCheckRequest(service=service)
                return (await health.Check(req)).status

            assert await status() == health_pb2.HealthCheckResponse.NOT_SERVING
            assert await status("tandem.v1.Generation") == health_pb2.HealthCheckResponse.NOT_SERVING
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await _collect(stub, _req())
            # No prefill worker would fall back to a decode worker's prefill: the missing role is decode.
            assert info.value.code() == S.UNAVAILABLE and "no decode workers" in info.value.details()

            workers = []
            for info_ in (
                worker_pb2.WorkerInfo(worker_id="p0", role=worker_pb2.WORKER_ROLE_PREFILL, grpc_addr=p_addr,
                                      bootstrap_addr="p0-bootstrap:1", model="tiny", max_context_len=4096,
                                      vocab_size=100),
                worker_pb2.WorkerInfo(worker_id="d0", role=worker_pb2.WORKER_ROLE_DECODE, grpc_addr=d_addr,
                                      model="tiny", max_context_len=2048, vocab_size=100),
            ):
                reg = RedisRegistry(redis_url, watch=False, ttl_s=1.0, heartbeat_s=0.1)
                await reg.start()
                await reg.announce(info_)
                workers.append(reg)
            await wait_until(lambda: router.can_route())
            await wait_until(lambda: router.health._server_status[""] == health_pb2.HealthCheckResponse.SERVING)
            assert await status() == health_pb2.HealthCheckResponse.SERVING

            out = await _collect(stub, _req())
            assert [t for m in out for t in m.token_ids] == [5]
            assert d.requests[0].prefill_bootstrap_addr == "p0-bootstrap:1"
            assert d.requests[0].prefill_worker_id == "p0"
            models = (await stub.ListModels(generation_pb2.ListModelsRequest())).models
            assert [(m.id, m.max_context_len, m.vocab_size) for m in models] == [("tiny", 2048, 100)]

            await workers[1].close()  # the decode worker leaves
            await wait_until(lambda: not router.can_route())
            await wait_until(lambda: router.health._server_status[""] == health_pb2.HealthCheckResponse.NOT_SERVING)
            assert d_addr not in router.channels.addresses()
            await workers[0].close()
            await channel.close()
        await p.stop()
        await d.stop()

    arun(body())


def test_request_timeout_fails_the_request_and_cancels_both():
    async def body():
        p, d = FakePrefill("hang"), FakeDecode("hang")
        async with cluster([p], [d], config=replace(BASE, request_timeout_s=0.3)) as (_, stub):
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await _collect(stub, _req())
            assert info.value.code() == S.DEADLINE_EXCEEDED
            await asyncio.wait_for(asyncio.gather(p.cancelled.wait(), d.cancelled.wait()), 2)

    arun(body())


def test_stop_drains_inflight_requests_and_is_idempotent():
    async def body():
        p, d = FakePrefill(), FakeDecode("stall", tokens=(1, 2))
        async with cluster([p], [d]) as (router, stub):
            call = stub.Generate(_req())
            assert list((await call.read()).token_ids) == [1]
            stopping = asyncio.ensure_future(router.stop(2.0))
            await asyncio.sleep(0.1)
            with pytest.raises(grpc.aio.AioRpcError):  # no new requests while draining
                await _collect(stub, _req())
            d.release.set()
            assert list((await call.read()).token_ids) == [2]
            assert await call.read() is grpc.aio.EOF
            assert await call.code() == S.OK
            await stopping
            await router.stop()  # again: no-op

    arun(body())


def test_metrics_endpoint_serves_prometheus_text():
    import urllib.request

    async def body():
        p, d = FakePrefill(), FakeDecode()
        async with cluster([p], [d], config=replace(BASE, metrics_port=0)) as (router, stub):
            await _collect(stub, _req())
            url = f"http://127.0.0.1:{router.metrics_port}/metrics"
            text = await asyncio.to_thread(lambda: urllib.request.urlopen(url, timeout=5).read().decode())
            assert 'tandem_router_requests_total{status="ok"} 1.0' in text
            assert 'tandem_router_workers{role="decode"} 1.0' in text
            assert "tandem_router_ttft_seconds_bucket" in text

    arun(body())


def test_short_prompt_is_prefilled_on_the_decode_worker_and_counted():
    async def main():
        p, d = FakePrefill(), FakeDecode()
        config = replace(BASE, route=RouteConfig(local_prefill_max_tokens=64))
        async with cluster([p], [d], config) as (router, stub):
            def ids(n, t):
                req = _req()
                req.token_ids.ids.extend([t] * n)  # replaces the text (one prompt field)
                return req

            short, long = await _collect(stub, ids(20, 5)), await _collect(stub, ids(200, 6))
            assert short and long
            local, remote = d.requests
            assert local.local_prefill and not local.prefill_worker_id and list(local.token_ids.ids) == [5] * 20
            assert not remote.local_prefill and remote.prefill_worker_id == p.addr
            assert [list(r.token_ids.ids) for r in p.requests] == [[6] * 200]  # P saw only the long one
            for route in ("local", "remote"):
                assert _metric(router, "tandem_router_prefill_route_total", route=route) == 1
            assert not router.servicer.planner.inflight and not router.servicer.planner.inflight_tokens

    arun(main())
