"""The synchronous client."""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
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


class Stream(Iterator[StreamChunk]):
    """The chunks of one generation. `cancel()` (or leaving a `with` block early) stops it on the
    server, which frees what it held there. Failures raise `tandem_client.errors` exceptions."""

    def __init__(self, client: Client, request: pb.GenerateRequest, timeout: float | None):
        self._client = client
        self._request = request
        self._attempts = Attempts(client.retry, timeout)
        self._call = None
        self._received = False
        self._cancelled = False

    @property
    def request_id(self) -> str:
        return self._request.request_id

    def __iter__(self) -> Stream:
        return self

    def __next__(self) -> StreamChunk:
        while True:
            if self._cancelled:
                raise StopIteration
            if self._call is None:
                self._call = self._client._generate(self._request, timeout=self._attempts.remaining(),
                                                    metadata=self._client.metadata,
                                                    wait_for_ready=self._client.wait_for_ready)
            try:
                msg = next(self._call)
            except StopIteration:
                raise
            except grpc.RpcError as e:
                if self._cancelled:
                    raise StopIteration from None
                delay = self._attempts.next_delay(e.code(), self._received)
                if delay is None:
                    raise from_rpc_error(e) from None
                time.sleep(delay)
                self._call = None
                continue
            self._received = True
            return chunk_from_pb(msg)

    def cancel(self) -> None:
        self._cancelled = True
        if self._call is not None:
            self._call.cancel()

    close = cancel

    def __enter__(self) -> Stream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.cancel()


class Client:
    """A Tandem client over one gRPC channel (thread-safe; reuse it).

    timeout: default deadline in seconds of each call, retries included (None: none).
    retry: retries of UNAVAILABLE before the first token. tls: True (system roots) or a TLSConfig.
    metadata: sent with every call (e.g. an authorization header for a proxy in front).
    api_key: the router's --api-key, sent as `authorization: Bearer KEY` (None: none).
    wait_for_ready: calls wait for the channel to connect instead of failing fast.
    """

    def __init__(self, target: str = "127.0.0.1:50051", *, timeout: float | None = None,
                 retry: RetryPolicy | None = None, tls: bool | TLSConfig = False,
                 metadata: Sequence[tuple[str, str]] = (), wait_for_ready: bool = False,
                 options: Sequence[tuple[str, Any]] = (), api_key: str | None = None):
        self.target = target
        self.timeout = timeout
        self.retry = retry if retry is not None else RetryPolicy()
        self.metadata = call_metadata(metadata, api_key)
        self.wait_for_ready = wait_for_ready
        creds, opts = channel_args(tls, options)
        self._channel = grpc.secure_channel(target, creds, opts) if creds else grpc.insecure_channel(target, opts)
        self._generate = self._channel.unary_stream(
            GENERATE, request_serializer=pb.GenerateRequest.SerializeToString,
            response_deserializer=pb.GenerateResponse.FromString)
        self._list_models = self._channel.unary_unary(
            LIST_MODELS, request_serializer=pb.ListModelsRequest.SerializeToString,
            response_deserializer=pb.ListModelsResponse.FromString)

    def stream(self, prompt: Prompt, params: SamplingParams | None = None, *, model: str = "",
               request_id: str = "", priority: int = 0, timeout: float | None = DEFAULT,
               **overrides: Any) -> Stream:
        """Start a generation; iterate the result for its chunks. `overrides` are SamplingParams fields."""
        request = build_request(prompt, merge_params(params, overrides), model, request_id, priority)
        return Stream(self, request, self.timeout if timeout is DEFAULT else timeout)

    def generate(self, prompt: Prompt, params: SamplingParams | None = None, *, model: str = "",
                 request_id: str = "", priority: int = 0, timeout: float | None = DEFAULT,
                 **overrides: Any) -> GenerateResult:
        """The whole generation (text, token ids, logprobs, finish reason, usage)."""
        result = GenerateResult()
        with self.stream(prompt, params, model=model, request_id=request_id, priority=priority, timeout=timeout,
                         **overrides) as s:
            for chunk in s:
                result.add(chunk)
        return result

    def list_models(self, timeout: float | None = DEFAULT) -> list[ModelInfo]:
        attempts = Attempts(self.retry, self.timeout if timeout is DEFAULT else timeout)
        while True:
            try:
                return models_from_pb(self._list_models(
                    pb.ListModelsRequest(), timeout=attempts.remaining(), metadata=self.metadata,
                    wait_for_ready=self.wait_for_ready))
            except grpc.RpcError as e:
                delay = attempts.next_delay(e.code(), False)
                if delay is None:
                    raise from_rpc_error(e) from None
                time.sleep(delay)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
