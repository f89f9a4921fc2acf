"""The shared secret of internal gRPC and the public API key: one interceptor on a real grpc.aio server
on 127.0.0.1 serving every internal service (unary and streaming), health open; loading the secret."""

from __future__ import annotations

import functools
import logging
import os

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from tandem.services.common.auth import (
    API_KEY_ENV,
    TOKEN_ENV,
    AuthConfigError,
    InternalAuth,
    deployment_env,
    load_api_key,
    read_token_file,
)
from tandem.v1 import generation_pb2, generation_pb2_grpc, worker_pb2, worker_pb2_grpc
from tests.services.common.conftest import arun

pytestmark = pytest.mark.timeout(60)

TOKEN = b"internal-secret-0123456789abcdef"
API_KEY = "sk-public-key"
GENERATION = "tandem.v1.Generation"


def synchronous(fn):
    @functools.wraps(fn)
    def run(*args, **kwargs):
        return arun(fn(*args, **kwargs), 30)
    return run


class _Prefill(worker_pb2_grpc.PrefillWorkerServicer):
    async def Prefill(self, request, context):
        return worker_pb2.PrefillResponse(request_id=request.request_id)


class _Decode(worker_pb2_grpc.DecodeWorkerServicer):
    async def Decode(self, request, context):
        yield generation_pb2.GenerateResponse(request_id=request.request_id)


class _Bootstrap(worker_pb2_grpc.BootstrapServicer):
    async def Bootstrap(self, request, context):
        return worker_pb2.BootstrapResponse(accepted=True)

    async def AbortRoom(self, request, context):
        return worker_pb2.AbortRoomResponse(acked=True)


class _Identity(worker_pb2_grpc.WorkerIdentityServicer):
    async def GetWorkerInfo(self, request, context):
        return worker_pb2.WorkerInfo(worker_id="w")


class _Generation(generation_pb2_grpc.GenerationServicer):
    async def Generate(self, request, context):
        yield generation_pb2.GenerateResponse(request_id=request.request_id)

    async def ListModels(self, request, context):
        return generation_pb2.ListModelsResponse()


async def _server(interceptor) -> tuple[grpc.aio.Server, str]:
    server = grpc.aio.server(interceptors=[interceptor])
    worker_pb2_grpc.add_PrefillWorkerServicer_to_server(_Prefill(), server)
    worker_pb2_grpc.add_DecodeWorkerServicer_to_server(_Decode(), server)
    worker_pb2_grpc.add_BootstrapServicer_to_server(_Bootstrap(), server)
    worker_pb2_grpc.add_WorkerIdentityServicer_to_server(_Identity(), server)
    generation_pb2_grpc.add_GenerationServicer_to_server(_Generation(), server)
    checker = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(checker, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    await checker.set("", health_pb2.HealthCheckResponse.SERVING)
    return server, f"127.0.0.1:{port}"


async def _every_call(channel: grpc.aio.Channel, metadata=None) -> dict[str, grpc.StatusCode]:
    """Each internal method once: its status code (OK when it answered)."""
    calls = {
        "Prefill": lambda: worker_pb2_grpc.PrefillWorkerStub(channel).Prefill(
            worker_pb2.PrefillRequest(request_id="r"), metadata=metadata, timeout=10),
        "Decode": lambda: _drain(worker_pb2_grpc.DecodeWorkerStub(channel).Decode(
            worker_pb2.DecodeRequest(request_id="r"), metadata=metadata, timeout=10)),
        "Bootstrap": lambda: worker_pb2_grpc.BootstrapStub(channel).Bootstrap(
            worker_pb2.BootstrapRequest(), metadata=metadata, timeout=10),
        "AbortRoom": lambda: worker_pb2_grpc.BootstrapStub(channel).AbortRoom(
            worker_pb2.AbortRoomRequest(), metadata=metadata, timeout=10),
        "GetWorkerInfo": lambda: worker_pb2_grpc.WorkerIdentityStub(channel).GetWorkerInfo(
            worker_pb2.WorkerInfoRequest(), metadata=metadata, timeout=10),
        "Generate": lambda: _drain(generation_pb2_grpc.GenerationStub(channel).Generate(
            generation_pb2.GenerateRequest(request_id="r"), metadata=metadata, timeout=10)),
        "ListModels": lambda: generation_pb2_grpc.GenerationStub(channel).ListModels(
            generation_pb2.ListModelsRequest(), metadata=metadata, timeout=10),
    }
    out = {}
    for name, call in calls.items():
        try:
            await call()
            out[name] = grpc.StatusCode.OK
        except grpc.aio.AioRpcError as e:
            out[name] = e.code()
            if e.code() == grpc.StatusCode.UNAUTHENTICATED:
                assert e.details().startswith("unauthenticated: ") and TOKEN.decode() not in e.details()
    return out


async def _drain(call) -> None:
    async for _ in call:
        pass


async def _healthy(channel) -> bool:
    resp = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
    return resp.status == health_pb2.HealthCheckResponse.SERVING


@synchronous
async def test_without_the_secret_every_internal_method_is_refused_and_health_stays_open(caplog):
    auth = InternalAuth(TOKEN)
    interceptor = auth.server_interceptor()
    server, addr = await _server(interceptor)
    try:
        with caplog.at_level(logging.WARNING, logger="tandem.services.common.auth"):
            async with grpc.aio.insecure_channel(addr) as bare:
                assert set((await _every_call(bare)).values()) == {grpc.StatusCode.UNAUTHENTICATED}
                wrong = (("tandem-internal-token", "not-the-secret-at-all"),)
                assert set((await _every_call(bare, wrong)).values()) == {grpc.StatusCode.UNAUTHENTICATED}
                assert await _healthy(bare)
            async with auth.channel(addr) as good:
                assert set((await _every_call(good)).values()) == {grpc.StatusCode.OK}
                assert await _healthy(good)
        assert interceptor.refused == 14
        assert "refused /tandem.v1.PrefillWorker/Prefill" in caplog.text and "no internal token" in caplog.text
        assert "wrong internal token" in caplog.text and TOKEN.decode() not in caplog.text
        assert "not-the-secret-at-all" not in caplog.text
    finally:
        await server.stop(0)


@synchronous
async def test_a_client_with_another_secret_is_refused():
    server, addr = await _server(InternalAuth(TOKEN).server_interceptor())
    try:
        async with InternalAuth(b"another-secret-0123456789abcdef").channel(addr) as other:
            assert set((await _every_call(other)).values()) == {grpc.StatusCode.UNAUTHENTICATED}
    finally:
        await server.stop(0)


@synchronous
async def test_without_a_configured_secret_everything_is_open():
    server, addr = await _server(InternalAuth().server_interceptor())
    try:
        async with InternalAuth().channel(addr) as channel:
            assert set((await _every_call(channel)).values()) == {grpc.StatusCode.OK}
    finally:
        await server.stop(0)


@synchronous
async def test_the_public_api_takes_the_api_key_or_the_internal_secret():
    """The router: Generation is public (API key, or the secret as the gateway sends it); the rest internal."""
    server, addr = await _server(InternalAuth(TOKEN).server_interceptor({GENERATION}, API_KEY))
    public = {"Generate", "ListModels"}
    try:
        async with grpc.aio.insecure_channel(addr) as bare:
            codes = await _every_call(bare)
            assert set(codes.values()) == {grpc.StatusCode.UNAUTHENTICATED}
            keyed = await _every_call(bare, (("authorization", f"Bearer {API_KEY}"),))
            assert {k for k, c in keyed.items() if c == grpc.StatusCode.OK} == public
            wrong = await _every_call(bare, (("authorization", "Bearer sk-wrong"),))
            assert set(wrong.values()) == {grpc.StatusCode.UNAUTHENTICATED}
        async with InternalAuth(TOKEN).channel(addr) as gateway:
            assert set((await _every_call(gateway)).values()) == {grpc.StatusCode.OK}
    finally:
        await server.stop(0)


@synchronous
async def test_without_an_api_key_the_public_api_is_open_and_the_rest_is_not():
    server, addr = await _server(InternalAuth(TOKEN).server_interceptor({GENERATION}, None))
    try:
        async with grpc.aio.insecure_channel(addr) as bare:
            codes = await _every_call(bare)
        assert {k for k, c in codes.items() if c == grpc.StatusCode.OK} == {"Generate", "ListModels"}
    finally:
        await server.stop(0)


def test_load_reads_the_file_then_the_environment(tmp_path, caplog):
    path = tmp_path / "token"
    path.write_bytes(TOKEN + b"\n")
    os.chmod(path, 0o600)
    assert InternalAuth.load(str(path), environ={TOKEN_ENV: "ignored-because-a-file-is-given"}).token == TOKEN
    assert InternalAuth.load(None, environ={TOKEN_ENV: " env-secret-0123456789 "}).token == b"env-secret-0123456789"
    assert not InternalAuth.load(None, environ={}).enabled
    os.chmod(path, 0o644)
    with caplog.at_level(logging.WARNING, logger="tandem.services.common.auth"):
        assert read_token_file(str(path)) == TOKEN
    assert "readable by every user" in caplog.text


def test_bad_secrets_are_clear_errors(tmp_path):
    empty = tmp_path / "empty"
    empty.write_bytes(b"\n")
    with pytest.raises(AuthConfigError, match="is empty"):
        InternalAuth.load(str(empty), environ={})
    with pytest.raises(AuthConfigError, match="cannot read"):
        InternalAuth.load(str(tmp_path / "missing"), environ={})
    with pytest.raises(AuthConfigError, match="at least 16"):
        InternalAuth.load(None, environ={TOKEN_ENV: "short"})
    with pytest.raises(AuthConfigError, match="printable ASCII"):
        InternalAuth(b"has a space in it, 0123456789")


def test_the_secret_is_never_printed_and_the_transfer_key_is_derived():
    auth = InternalAuth(TOKEN)
    assert TOKEN.decode() not in repr(auth)
    assert auth.transfer_key is not None and len(auth.transfer_key) == 32 and TOKEN not in auth.transfer_key
    assert InternalAuth().transfer_key is None


def test_tandem_up_makes_a_secret_unless_one_is_configured():
    made = deployment_env({"PATH": "/bin"}, None)
    assert len(made[TOKEN_ENV]) >= 32 and made["PATH"] == "/bin"
    assert deployment_env({}, None)[TOKEN_ENV] != made[TOKEN_ENV]
    assert deployment_env({TOKEN_ENV: "mine-0123456789abcdef"}, None)[TOKEN_ENV] == "mine-0123456789abcdef"
    assert TOKEN_ENV not in deployment_env({}, "/etc/tandem/token")


def test_api_key_from_flag_then_environment():
    assert load_api_key("k1", environ={API_KEY_ENV: "k2"}) == "k1"
    assert load_api_key(None, environ={API_KEY_ENV: "k2"}) == "k2"
    assert load_api_key(None, environ={}) is None
    with pytest.raises(AuthConfigError):
        load_api_key("  ", environ={})


@synchronous
async def test_a_strangers_bytes_are_refused_before_they_are_parsed():
    server, addr = await _server(InternalAuth(TOKEN).server_interceptor())
    try:
        async with grpc.aio.insecure_channel(addr) as bare:
            raw = bare.unary_unary("/tandem.v1.PrefillWorker/Prefill")     # no serializers: raw bytes
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await raw(b"\xff\xff\xff not a protobuf message", timeout=10)
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    finally:
        await server.stop(0)
