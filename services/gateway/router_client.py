"""The gateway's gRPC client of the router: one grpc.aio channel, Generate streams, ListModels, health."""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tandem.services.common import tracing
from tandem.services.common.auth import InternalAuth
from tandem.services.gateway.errors import APIError
from tandem.v1 import generation_pb2, generation_pb2_grpc

MAX_MESSAGE_BYTES = 64 << 20
CHANNEL_OPTIONS = (
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    # A restarted router is reachable again within ~1 s, not after gRPC's default minutes of backoff.
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
)   # InternalAuth.channel adds keepalive: a router host that went silent fails its streams within seconds


class RouterClient:
    """Lifecycle: create (inside the event loop that uses it) → calls → `close()` (idempotent)."""

    def __init__(self, addr: str, request_timeout_s: float = 0.0, auth: InternalAuth = InternalAuth()):
        self.addr = addr
        self.request_timeout_s = request_timeout_s
        self._channel = auth.channel(addr, options=CHANNEL_OPTIONS)   # calls carry the internal secret
        self._stub = generation_pb2_grpc.GenerationStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)
        self._closed = False

    async def generate(self, request: generation_pb2.GenerateRequest) -> AsyncIterator[generation_pb2.GenerateResponse]:
        """The router's chunks; raises APIError. Closing (or cancelling) the iterator cancels the call,
        which makes the router abort the request on its workers and free their pages."""
        call = self._stub.Generate(request, timeout=self.request_timeout_s or None, metadata=tracing.outgoing())
        try:
            while True:
                msg = await call.read()
                if msg is grpc.aio.EOF:
                    return
                yield msg
        except grpc.aio.AioRpcError as e:
            raise APIError.from_rpc(e) from None
        finally:
            call.cancel()  # a no-op once the call has finished

    @property
    def channel(self) -> grpc.aio.Channel:
        """The channel to the router (other services of it, e.g. LoraAdmin, share it)."""
        return self._channel

    async def list_models(self, timeout_s: float = 5.0) -> list[generation_pb2.ModelInfo]:
        try:
            resp = await self._stub.ListModels(generation_pb2.ListModelsRequest(), timeout=timeout_s)
        except grpc.aio.AioRpcError as e:
            raise APIError(503, f"router {self.addr} is unavailable: {e.details() or e.code().name}") from None
        return list(resp.models)

    async def serving(self, timeout_s: float = 2.0) -> bool:
        """Whether the router says it can route (both roles have workers)."""
        try:
            resp = await self._health.Check(health_pb2.HealthCheckRequest(service=""), timeout=timeout_s)
        except grpc.aio.AioRpcError:
            return False
        return resp.status == health_pb2.HealthCheckResponse.SERVING

    async def close(self) -> None:
        if not self._closed:
            self._closed = True
            await self._channel.close()
