"""The router's public port answers a generic client's reflection under the public API's rule: open
without an API key, the key when one is set (or the internal secret); health stays open for probes."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tandem.services.common.auth import InternalAuth
from tandem.services.common.registry import StaticRegistry
from tandem.services.router.server import RouterServer
from tests.services.common.conftest import arun
from tests.services.router.fakes import dead_addr
from tests.services.router.reflection_client import describe
from tests.services.router.test_router import BASE

TOKEN = b"internal-secret-0123456789abcdef"
GENERATION = "tandem.v1.Generation"


def _with_router(api_key: str | None, check) -> None:
    """Run `check(addr)` (blocking gRPC calls, in a thread) against a router with the internal secret set."""
    async def body():
        registry = StaticRegistry(prefill=[dead_addr()], decode=[dead_addr()], probe_s=0)
        router = RouterServer(replace(BASE, auth=InternalAuth(TOKEN), api_key=api_key), registry)
        await router.start()
        try:
            await asyncio.to_thread(check, router.grpc_addr)
        finally:
            await router.stop(0)

    arun(body(), 60)


def _health_open(addr: str) -> None:
    with grpc.insecure_channel(addr) as channel:
        health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service="liveness"), timeout=10)


def test_without_an_api_key_reflection_is_as_open_as_the_public_api():
    def check(addr):
        services, methods = describe(addr, GENERATION)
        assert GENERATION in services and "grpc.health.v1.Health" in services
        assert {"Generate", "ListModels"} <= set(methods)
        _health_open(addr)

    _with_router(None, check)


def test_with_an_api_key_reflection_wants_it_and_health_stays_open():
    def check(addr):
        for metadata in ((), (("authorization", "Bearer sk-wrong"),)):
            with pytest.raises(grpc.RpcError) as e:
                describe(addr, GENERATION, metadata)
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        services, methods = describe(addr, GENERATION, (("authorization", "Bearer sk-key"),))
        assert GENERATION in services and "Generate" in methods
        # the internal secret (what the gateway presents) is as good as the key
        assert GENERATION in describe(addr, GENERATION, (("tandem-internal-token", TOKEN.decode()),))[0]
        _health_open(addr)

    _with_router("sk-key", check)
