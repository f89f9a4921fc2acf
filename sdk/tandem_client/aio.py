"""The asyncio client (grpc.aio)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

import grpc

from tandem_client._channel import DEFAULT, Attempts, call_metadata, channel_args
from tandem_client._convert import (
    GENERATE,
    LIST_MODELS,
    Prompt,
    build_request,
    chunk_from_pb,
    merge_params,
    models_from_pb,
)
from tandem_client._proto import generation_pb2 as pb
from tandem_client.errors import from_rpc_error
from tandem_client.types import GenerateResult, ModelInfo, RetryPolicy, SamplingParams, StreamChunk, TLSConfig


@dataclass(frozen=True)
class _Methods:
    generate: grpc.aio.UnaryStreamMultiCallable
    list_models: grpc.aio.UnaryUnaryMultiCallable


class AsyncStream(AsyncIterator[StreamChunk]):
    """The chunks of one generation. `cancel()` (or leaving an `async with` block early, or cancelling
    the task that iterates it) stops it on the server, which frees what it held there."""

    def __init__(self, client: AsyncClient, request: pb.GenerateRequest, timeout: float | None):
        self._client = client
        self._request = request
        self._attempts = Attempts(client.retry, timeout)
        self._call: grpc.aio.UnaryStreamCall | None = None
        self._received = False
        self._cancelled = False

    @property
    def request_id(self) -> str:
        return self._request.request_id

    def __aiter__(self) -> AsyncStream:
        return self

    async def __anext__(self) -> StreamChunk:
        while True:
            if self._cancelled:
                raise StopAsyncIteration
            if self._call is None:
                self._call = self._client._open().generate(
                    self._request, timeout=self._attempts.remaining(), metadata=self._client.metadata,
                    wait_for_ready=self._client.wait_for_ready)
            try:
                msg = await self._call.read()
            except asyncio.CancelledError:
                self.cancel()
                raise
            except grpc.RpcError as e:
                if self._cancelled:
                    raise StopAsyncIteration from None
                delay = self._attempts.next_delay(e.code(), self._received)
                if delay is None:
                    raise from_rpc_error(e) from None
                await asyncio.sleep(delay)
                self._call = None
                continue
            if msg is grpc.aio.EOF:
                raise StopAsyncIteration
            self._received = True
            return chunk_from_pb(msg)

    def cancel(self) -> None:
        self._cancelled = True
        if self._call is not None:
            self._call.cancel()

    async def aclose(self) -> None:
        self.cancel()

    async def __aenter__(self) -> AsyncStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.cancel()


class AsyncClient:
    """The asyncio twin of `Client` (same arguments). The channel opens on first use, inside the
    running event loop; close it with `await client.close()` or `async with`."""

    def __init__(self, target: str = "127.0.0.1:50051", *, timeout: float | None = None,
                 retry: RetryPolicy | None = None, tls: bool | TLSConfig = False,
                 metadata: Sequence[tuple[str, str]] = (), wait_for_ready: bool = False,
                 options: Sequence[tuple[str, Any]] = (), api_key: str | None = None):
        self.target = target
        self.timeout = timeout
        self.retry = retry if retry is not None else RetryPolicy()
        self.metadata = call_metadata(metadata, api_key)
        self.wait_for_ready = wait_for_ready
        self._creds, self._options = channel_args(tls, options)
        self._channel: grpc.aio.Channel | None = None
        self._methods: _Methods | None = None

    def _open(self) -> _Methods:
        """The channel's two RPCs; the channel is created on first use, in the running loop."""
        if self._methods is None:
            self._channel = (grpc.aio.secure_channel(self.target, self._creds, self._options) if self._creds
                             else grpc.aio.insecure_channel(self.target, self._options))
            self._methods = _Methods(
                generate=self._channel.unary_stream(
                    GENERATE, request_serializer=pb.GenerateRequest.SerializeToString,
                    response_deserializer=pb.GenerateResponse.FromString),
                list_models=self._channel.unary_unary(
                    LIST_MODELS, request_serializer=pb.ListModelsRequest.SerializeToString,
                    response_deserializer=pb.ListModelsResponse.FromString),
            )
        return self._methods

    def stream(self, prompt: Prompt, params: SamplingParams | None = None, *, model: str = "",
               request_id: str = "", priority: int = 0, timeout: float | None = DEFAULT,
               **overrides: Any) -> AsyncStream:
        """Start a generation; `async for` over the result for its chunks."""
        request = build_request(prompt, merge_params(params, overrides), model, request_id, priority)
        return AsyncStream(self, request, self.timeout if timeout is DEFAULT else timeout)

    async def generate(self, prompt: Prompt, params: SamplingParams | None = None, *, model: str = "",
                       request_id: str = "", priority: int = 0, timeout: float | None = DEFAULT,
                 **overrides: Any) -> GenerateResult:
        result = GenerateResult()
        async with self.stream(prompt, params, model=model, request_id=request_id, priority=priority,
                               timeout=timeout, **overrides) as s:
            async for chunk in s:
                result.add(chunk)
        return result

    async def list_models(self, timeout: float | None = DEFAULT) -> list[ModelInfo]:
        list_models = self._open().list_models
        attempts = Attempts(self.retry, self.timeout if timeout is DEFAULT else timeout)
        while True:
            try:
                return models_from_pb(await list_models(
                    pb.ListModelsRequest(), timeout=attempts.remaining(), metadata=self.metadata,
                    wait_for_ready=self.wait_for_ready))
            except grpc.RpcError as e:
                delay = attempts.next_delay(e.code(), False)
                if delay is None:
                    raise from_rpc_error(e) from None
                await asyncio.sleep(delay)

    async def close(self) -> None:
        """Close the channel (idempotent); a later call opens a new one."""
        if self._channel is not None:
            channel, self._channel, self._methods = self._channel, None, None
            await channel.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
