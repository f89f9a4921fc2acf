"""Fake prefill / decode / co-located workers: real grpc.aio servers on 127.0.0.1, for unit tests only.

Each fake records the requests it got and sets `cancelled` when the router cancels its call, so a
test can assert on what the workers observed.
"""

from __future__ import annotations

import asyncio
import socket

import grpc

from tandem.services.common import keepalive
from tandem.v1 import generation_pb2, generation_pb2_grpc, worker_pb2, worker_pb2_grpc


def dead_addr() -> str:
    """An address on which nothing listens (connecting fails with UNAVAILABLE)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


class _Fake:
    def __init__(self) -> None:
        self.requests: list = []
        self.received = asyncio.Event()
        self.cancelled = asyncio.Event()
        self.release = asyncio.Event()  # lets a "hang" behaviour finish
        self.after: asyncio.Event | None = None  # act only once this is set (e.g. the peer fake's `received`)
        self.server: grpc.aio.Server | None = None
        self.addr = ""

    async def _observe(self, handler, request, context):
        # grpc.aio cancels the handler's task when the caller cancels; `context.cancelled()` stays False.
        self.requests.append(request)
        self.received.set()
        try:
            if self.after is not None:
                await self.after.wait()
            return await handler(request, context)
        except asyncio.CancelledError:
            self.cancelled.set()
            raise

    async def start(self) -> str:
        self.server = grpc.aio.server(options=keepalive.SERVER_OPTIONS)  # as the real workers'
        self._add(self.server)
        port = self.server.add_insecure_port("127.0.0.1:0")
        await self.server.start()
        self.addr = f"127.0.0.1:{port}"
        return self.addr

    async def stop(self) -> None:
        if self.server is not None:
            await self.server.stop(0)


class FakePrefill(_Fake, worker_pb2_grpc.PrefillWorkerServicer):
    """behaviour: "ok" (SUCCESS at once), "hang" (until released or cancelled, then SUCCESS),
    "failed" (a FAILED response), or a grpc.StatusCode to abort with."""

    def __init__(self, behaviour="ok", error: str = "boom", delay_s: float = 0.0) -> None:
        super().__init__()
        self.behaviour = behaviour
        self.error = error
        self.delay_s = delay_s           # answers this much later

    def _add(self, server) -> None:
        worker_pb2_grpc.add_PrefillWorkerServicer_to_server(self, server)

    async def Prefill(self, request, context):
        return await self._observe(self._prefill, request, context)

    async def _prefill(self, request, context):
        ok = worker_pb2.PrefillResponse(
            request_id=request.request_id, bootstrap_room=request.bootstrap_room,
            state=worker_pb2.TRANSFER_STATE_SUCCESS,
        )
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        if self.behaviour == "ok":
            return ok
        if self.behaviour == "hang":
            await self.release.wait()
            return ok
        if self.behaviour == "failed":
            return worker_pb2.PrefillResponse(
                request_id=request.request_id, bootstrap_room=request.bootstrap_room,
                state=worker_pb2.TRANSFER_STATE_FAILED, error=self.error,
            )
        await context.abort(self.behaviour, self.error)


class FakeDecode(_Fake, worker_pb2_grpc.DecodeWorkerServicer):
    """Streams `tokens` one chunk each. behaviour: "ok", "hang" (never starts until released),
    "stall" (sends the first chunk, then waits until released), or a grpc.StatusCode to abort with.
    `kv_delay_s`: a request with a prefill worker starts that much later (its KV is on the way), as a
    real decode worker cannot stream before the KV arrived; a local prefill starts at once."""

    def __init__(self, behaviour="ok", tokens=(11, 12, 13), error: str = "bad request", param: str = "",
                 kv_delay_s: float = 0.0) -> None:
        super().__init__()
        self.behaviour = behaviour
        self.kv_delay_s = kv_delay_s
        self.tokens = tokens
        self.error = error
        self.param = param

    def _add(self, server) -> None:
        worker_pb2_grpc.add_DecodeWorkerServicer_to_server(self, server)

    async def Decode(self, request, context):
        await self._observe(self._decode, request, context)

    async def _decode(self, request, context):
        if isinstance(self.behaviour, grpc.StatusCode):
            trailing = (("tandem-error-param", self.param),) if self.param else ()
            await context.abort(self.behaviour, self.error, trailing)
        if self.behaviour == "hang":
            await self.release.wait()
        if self.kv_delay_s and not request.local_prefill:
            await asyncio.sleep(self.kv_delay_s)
        for i, tok in enumerate(self.tokens):
            last = i == len(self.tokens) - 1
            await context.write(
                generation_pb2.GenerateResponse(
                    request_id=request.request_id, token_ids=[tok], text=f"<{tok}>",
                    finish_reason=generation_pb2.FINISH_REASON_LENGTH if last else 0,
                )
            )
            if i == 0 and self.behaviour == "stall":
                await self.release.wait()


class FakeColocated(_Fake, generation_pb2_grpc.GenerationServicer):
    def __init__(self, tokens=(21, 22)) -> None:
        super().__init__()
        self.tokens = tokens

    def _add(self, server) -> None:
        generation_pb2_grpc.add_GenerationServicer_to_server(self, server)

    async def Generate(self, request, context):
        await self._observe(self._generate, request, context)

    async def _generate(self, request, context):
        for tok in self.tokens:
            await context.write(generation_pb2.GenerateResponse(request_id=request.request_id, token_ids=[tok]))
