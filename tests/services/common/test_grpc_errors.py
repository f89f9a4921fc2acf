from __future__ import annotations

import grpc
import pytest

from tandem.engine.errors import InvalidRequest, ModelNotFound, RequestAborted, ResourceExhausted, TandemError
from tandem.services.common.grpc_errors import (
    RpcFailed,
    abort_with,
    error_from_rpc,
    error_from_status,
    status_for,
)
from tandem.v1 import generation_pb2, generation_pb2_grpc
from tests.services.common.conftest import arun

S = grpc.StatusCode


@pytest.mark.parametrize(
    ("exc", "code"),
    [
        (InvalidRequest("bad", "top_p"), S.INVALID_ARGUMENT),
        (ModelNotFound("nope"), S.NOT_FOUND),
        (ResourceExhausted("full"), S.RESOURCE_EXHAUSTED),
        (RequestAborted("gone"), S.CANCELLED),
        (TandemError("other"), S.INTERNAL),
        (RuntimeError("bug"), S.INTERNAL),
        (RpcFailed(S.UNAVAILABLE, "down"), S.UNAVAILABLE),
    ],
)
def test_status_for(exc, code):
    assert status_for(exc) == code


def test_error_from_status_round_trips_the_typed_errors():
    for cls in (InvalidRequest, ModelNotFound, ResourceExhausted, RequestAborted):
        exc = error_from_status(status_for(cls("x")), "x")
        assert type(exc) is cls and str(exc) == "x"
    err = error_from_status(S.INVALID_ARGUMENT, "top_p must be in (0, 1]", "top_p")
    assert err.param == "top_p"
    other = error_from_status(S.UNAVAILABLE, "down")
    assert isinstance(other, RpcFailed) and other.code == S.UNAVAILABLE


class _Failing(generation_pb2_grpc.GenerationServicer):
    def __init__(self, exc):
        self.exc = exc

    async def ListModels(self, request, context):
        await abort_with(context, self.exc)


def test_abort_with_reaches_the_client_with_code_message_and_param():
    async def body(exc):
        server = grpc.aio.server()
        generation_pb2_grpc.add_GenerationServicer_to_server(_Failing(exc), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await generation_pb2_grpc.GenerationStub(ch).ListModels(generation_pb2.ListModelsRequest())
        finally:
            await server.stop(0)
        return info.value

    rpc_err = arun(body(InvalidRequest("top_p must be in (0, 1], got 2.0", "top_p")))
    assert rpc_err.code() == S.INVALID_ARGUMENT
    typed = error_from_rpc(rpc_err)
    assert isinstance(typed, InvalidRequest)
    assert (str(typed), typed.param) == ("top_p must be in (0, 1], got 2.0", "top_p")

    rpc_err = arun(body(ResourceExhausted("queue full")))
    assert rpc_err.code() == S.RESOURCE_EXHAUSTED and isinstance(error_from_rpc(rpc_err), ResourceExhausted)
