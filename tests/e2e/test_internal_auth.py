"""A real deployment closes its internal endpoints to strangers: without the shared secret every
internal gRPC method of every worker answers UNAUTHENTICATED, health stays open, the router's public
API wants its API key, and requests through the front door still work end to end (router -> workers,
decode -> prefill bootstrap, the KV transfer handshake, all with the secret)."""

from __future__ import annotations

import os
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tandem.v1 import generation_pb2, generation_pb2_grpc, worker_pb2, worker_pb2_grpc
from tests.e2e.stack import API_KEY, INTERNAL_METADATA, Service, Stack, gateway_stack
from tests.services.common.tls_certs import make_ca, make_cert, needs_openssl
from tests.services.router.reflection_client import call_streaming, describe

pytestmark = pytest.mark.timeout(300)

UNAUTHENTICATED = grpc.StatusCode.UNAUTHENTICATED
GENERATION = "tandem.v1.Generation"


@pytest.fixture(scope="module")
def stack(request, tiny_llama):
    return gateway_stack(request.config, tiny_llama)


def _code(call) -> grpc.StatusCode:
    try:
        result = call()
        if hasattr(result, "__next__"):
            list(result)
        return grpc.StatusCode.OK
    except grpc.RpcError as e:
        return e.code()


def _internal_calls(channel: grpc.Channel, role: str, metadata=()) -> dict[str, object]:
    identity = worker_pb2_grpc.WorkerIdentityStub(channel)
    calls = {"GetWorkerInfo": lambda: identity.GetWorkerInfo(worker_pb2.WorkerInfoRequest(), metadata=metadata,
                                                             timeout=10)}
    if role == "prefill":
        boot = worker_pb2_grpc.BootstrapStub(channel)
        calls |= {
            "Prefill": lambda: worker_pb2_grpc.PrefillWorkerStub(channel).Prefill(
                worker_pb2.PrefillRequest(request_id="stranger", bootstrap_room=1, text="hi"), metadata=metadata,
                timeout=10),
            "Bootstrap": lambda: boot.Bootstrap(worker_pb2.BootstrapRequest(bootstrap_room=1, dst_page_ids=[0]),
                                                metadata=metadata, timeout=10),
            "AbortRoom": lambda: boot.AbortRoom(worker_pb2.AbortRoomRequest(bootstrap_room=1), metadata=metadata,
                                                timeout=10),
        }
    elif role == "decode":
        calls["Decode"] = lambda: worker_pb2_grpc.DecodeWorkerStub(channel).Decode(
            worker_pb2.DecodeRequest(request_id="stranger", bootstrap_room=1, text="hi",
                                     prefill_bootstrap_addr="127.0.0.1:1"), metadata=metadata, timeout=10)
        calls["SendPrefix"] = lambda: worker_pb2_grpc.KVSourceStub(channel).SendPrefix(
            worker_pb2.SendPrefixRequest(bootstrap_room=1, prefill_worker_id="stranger", dst_page_ids=[0]),
            metadata=metadata, timeout=10)
    else:
        gen = generation_pb2_grpc.GenerationStub(channel)
        calls |= {
            "Generate": lambda: gen.Generate(generation_pb2.GenerateRequest(text="hi"), metadata=metadata, timeout=30),
            "ListModels": lambda: gen.ListModels(generation_pb2.ListModelsRequest(), metadata=metadata, timeout=10),
        }
    return calls


def _serving(channel: grpc.Channel) -> bool:
    resp = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
    return resp.status == health_pb2.HealthCheckResponse.SERVING


def test_every_internal_endpoint_refuses_a_caller_without_the_secret(stack):
    for worker in stack.info["workers"]:
        with grpc.insecure_channel(worker["grpc_addr"]) as channel:
            codes = {name: _code(call) for name, call in _internal_calls(channel, worker["role"]).items()}
            wrong = (("tandem-internal-token", "x" * 40),)
            codes |= {f"{name} (wrong secret)": _code(call)
                      for name, call in _internal_calls(channel, worker["role"], wrong).items()}
            assert set(codes.values()) == {UNAUTHENTICATED}, (worker["role"], codes)
            assert _serving(channel)                                # probes need no secret
            info = worker_pb2_grpc.WorkerIdentityStub(channel).GetWorkerInfo(
                worker_pb2.WorkerInfoRequest(), metadata=INTERNAL_METADATA, timeout=10)
            assert info.worker_id == worker["worker_id"]
    for worker in stack.info["workers"]:                            # the strangers left nothing behind
        free, total = stack.wait_pages_free(worker)
        assert free == total


def test_the_public_api_wants_its_key_and_requests_still_flow(stack):
    gen = generation_pb2_grpc.GenerationStub(stack.channel)
    request = generation_pb2.GenerateRequest(token_ids=generation_pb2.TokenIds(ids=[5, 6, 7]),
                                             sampling=generation_pb2.SamplingParams(max_tokens=4, ignore_eos=True))
    assert _code(lambda: gen.Generate(request, timeout=60)) == UNAUTHENTICATED
    assert _code(lambda: gen.Generate(request, timeout=60, metadata=(("authorization", "Bearer nope"),))) \
        == UNAUTHENTICATED
    chunks = list(gen.Generate(request, timeout=60, metadata=(("authorization", f"Bearer {API_KEY}"),)))
    assert sum(len(c.token_ids) for c in chunks) == 4
    assert gen.ListModels(generation_pb2.ListModelsRequest(), timeout=10,
                          metadata=INTERNAL_METADATA).models


@pytest.mark.slow
def test_up_makes_a_secret_of_its_own_that_is_in_no_command_line(tiny_llama: Path):
    env = {k: v for k, v in os.environ.items() if k != "TANDEM_INTERNAL_TOKEN"}
    stack = Stack("--mode", "colocated", "--model", str(tiny_llama), "--dtype", "float32",
                  "--max-total-tokens", "1024", env=dict(env, PYTHONUNBUFFERED="1"))
    try:
        assert len(stack.generate([5, 6, 7], max_tokens=3, ignore_eos=True).token_ids) == 3
        worker = stack.info["workers"][0]
        with grpc.insecure_channel(worker["grpc_addr"]) as channel:
            codes = {name: _code(call) for name, call in _internal_calls(channel, "colocated").items()}
        assert set(codes.values()) == {UNAUTHENTICATED}, codes
        cmdline = Path(f"/proc/{worker['pid']}/cmdline").read_bytes()
        assert b"internal-token" not in cmdline and b"TANDEM_INTERNAL_TOKEN" not in cmdline
    finally:
        stack.close()


@needs_openssl
def test_up_with_mutual_tls_on_internal_grpc(tiny_llama: Path, tmp_path: Path):
    ca = make_ca(tmp_path, "ca")
    cert, key = make_cert(tmp_path, ca, "node")
    stack = Stack("--model", str(tiny_llama), "--dtype", "float32", "--max-total-tokens", "1024",
                  "--tls-cert", str(cert), "--tls-key", str(key), "--tls-ca", str(ca[0]))
    try:
        # router -> prefill / decode and decode -> prefill all went over mutual TLS
        assert len(stack.generate([5, 6, 7], max_tokens=3, ignore_eos=True).token_ids) == 3
        for worker in stack.info["workers"]:
            with grpc.insecure_channel(worker["grpc_addr"]) as plaintext:
                assert _code(lambda ch=plaintext: _serving(ch)) == grpc.StatusCode.UNAVAILABLE
    finally:
        stack.close()


def test_a_generic_client_learns_the_public_api_through_reflection_with_the_api_key(stack):
    """grpcurl's way, no Tandem stubs: the router's reflection wants the API key as its public API does;
    with it, the client lists the services, resolves tandem.v1.Generation and generates from JSON.
    A worker's reflection stays internal."""
    router, key = stack.info["router"], (("authorization", f"Bearer {API_KEY}"),)
    for metadata in ((), (("authorization", "Bearer nope"),)):
        with pytest.raises(grpc.RpcError) as e:
            describe(router, GENERATION, metadata)
        assert e.value.code() == UNAUTHENTICATED
    services, methods = describe(router, GENERATION, key)
    assert GENERATION in services and {"Generate", "ListModels"} <= set(methods)
    chunks = call_streaming(router, GENERATION, "Generate",
                            {"tokenIds": {"ids": [5, 6, 7]}, "sampling": {"maxTokens": 3, "ignoreEos": True}}, key)
    assert sum(len(c.get("tokenIds", [])) for c in chunks) == 3
    worker = stack.workers("decode")[0]["grpc_addr"]
    with pytest.raises(grpc.RpcError) as e:
        describe(worker, "tandem.v1.DecodeWorker", key)
    assert e.value.code() == UNAUTHENTICATED
    assert "tandem.v1.DecodeWorker" in describe(worker, "tandem.v1.DecodeWorker", INTERNAL_METADATA)[0]


def test_without_an_api_key_the_routers_reflection_is_open(stack):
    router = Service("tandem.cli", "router", "--port", "0", "--redis-url", stack.info["redis_url"],
                     "--metrics-port", "-1")
    try:
        addr = router.wait_ready()["grpc_addr"]
        services, methods = describe(addr, GENERATION)
        assert GENERATION in services and "Generate" in methods
    finally:
        router.close()
