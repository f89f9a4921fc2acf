"""Request size limits: the checks themselves, the router's use of them (a real router in front of
fake workers on 127.0.0.1: INVALID_ARGUMENT / RESOURCE_EXHAUSTED before any worker is called), and
the flags that carry them from `tandem up` to the router and the gateway."""

from __future__ import annotations

from dataclasses import replace

import grpc
import pytest

from tandem.cli.main import build_parser
from tandem.cli.up_cmd import router_args
from tandem.engine.errors import InvalidRequest
from tandem.services.common.limits import RequestLimits
from tandem.services.router.config import RouterConfig
from tandem.v1 import generation_pb2
from tests.services.common.conftest import arun
from tests.services.router.fakes import FakeDecode, FakePrefill
from tests.services.router.test_router import BASE, _collect, cluster

pytestmark = pytest.mark.timeout(60)

LIMITS = RequestLimits(max_request_bytes=4096, max_input_tokens=8, max_output_tokens=20, max_stop_sequences=2,
                       max_stop_length=5)


def test_each_limit_names_its_parameter_and_its_flag():
    cases = [
        (lambda: LIMITS.check_prompt_tokens(9), "prompt", "--max-input-tokens"),
        (lambda: LIMITS.check_prompt_tokens(9, "messages"), "messages", "--max-input-tokens"),
        (lambda: LIMITS.check_max_tokens(21, "max_completion_tokens"), "max_completion_tokens", "--max-output-tokens"),
        (lambda: LIMITS.check_stop(["a", "b", "c"]), "stop", "--max-stop-sequences"),
        (lambda: LIMITS.check_stop("abcdef"), "stop", "--max-stop-length"),
    ]
    for check, param, flag in cases:
        with pytest.raises(InvalidRequest) as e:
            check()
        assert e.value.param == param and flag in e.value.message
    LIMITS.check_prompt_tokens(8)
    LIMITS.check_max_tokens(20)
    LIMITS.check_max_tokens(None)
    LIMITS.check_stop(["abcde", "x"])
    LIMITS.check_stop(None)
    open_ = RequestLimits(max_input_tokens=0, max_output_tokens=0)
    open_.check_prompt_tokens(10**6)
    open_.check_max_tokens(10**6)


def test_bad_limits_are_refused():
    for bad in (dict(max_request_bytes=10), dict(max_input_tokens=-1), dict(max_stop_sequences=-2)):
        with pytest.raises(ValueError, match="--max-"):
            RequestLimits(**bad).validate()


def _req(ids=(1, 2, 3), max_tokens=4, stop=()) -> generation_pb2.GenerateRequest:
    return generation_pb2.GenerateRequest(token_ids=generation_pb2.TokenIds(ids=list(ids)),
                                          sampling=generation_pb2.SamplingParams(max_tokens=max_tokens, stop=stop))


def test_the_router_refuses_requests_over_its_limits_before_any_worker_sees_them():
    async def body():
        prefill, decode = FakePrefill(), FakeDecode()
        async with cluster([prefill], [decode], config=replace(BASE, limits=LIMITS)) as (router, stub):
            refused = {}
            for name, req in {"prompt": _req(ids=range(9)), "max_tokens": _req(max_tokens=21),
                              "stop": _req(stop=["a", "b", "c"]), "stop length": _req(stop=["abcdef"])}.items():
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await _collect(stub, req)
                refused[name] = (e.value.code(), e.value.details())
            with pytest.raises(grpc.aio.AioRpcError) as e:            # a message over --max-request-bytes
                await _collect(stub, generation_pb2.GenerateRequest(text="x" * 5000))
            refused["bytes"] = (e.value.code(), e.value.details())
            ok = await _collect(stub, _req(ids=range(8), max_tokens=20, stop=["abcde", "z"]))
            return refused, ok, len(prefill.requests)

    refused, ok, prefills = arun(body(), 30)
    assert {k: c for k, (c, _) in refused.items()} == {
        "prompt": grpc.StatusCode.INVALID_ARGUMENT, "max_tokens": grpc.StatusCode.INVALID_ARGUMENT,
        "stop": grpc.StatusCode.INVALID_ARGUMENT, "stop length": grpc.StatusCode.INVALID_ARGUMENT,
        "bytes": grpc.StatusCode.RESOURCE_EXHAUSTED}
    assert "--max-input-tokens" in refused["prompt"][1] and "--max-stop-length" in refused["stop length"][1]
    assert ok and prefills == 1                                    # only the good request reached a worker


def test_up_forwards_the_limits_to_router_and_gateway():
    from tandem.services.gateway.config import GatewayConfig

    flags = ["--max-request-bytes", "5000", "--max-input-tokens", "7", "--max-output-tokens", "9",
             "--max-stop-sequences", "3", "--max-stop-length", "11"]
    up = build_parser().parse_args(["up", *flags])
    expected = RequestLimits(5000, 7, 9, 3, 11)
    router = RouterConfig.from_args(build_parser().parse_args(["router", "--prefill", "a:1", "--decode", "b:2",
                                                               *router_args(up)]))
    assert router.limits == expected
    gateway = GatewayConfig.from_args(build_parser().parse_args(["gateway", *flags]))
    assert gateway.limits == expected
    assert RouterConfig.from_args(build_parser().parse_args(["router", "--prefill", "a:1", "--decode", "b:2"])
                                  ).limits == RequestLimits()
