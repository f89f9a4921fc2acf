"""An in-process `tandem.v1.Generation` server for unit tests of the SDK and the gateway.

The default handler streams one token per chunk (token id = 300 + i, text "t{i} ") and finishes
with usage; tests swap in handlers that fail, stall or count calls. Every call is recorded, and
`cancelled` lists the request ids whose call ended before the handler returned.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures

import grpc

from tandem.v1 import generation_pb2 as pb
from tandem.v1 import generation_pb2_grpc as pb_grpc

Handler = Callable[[pb.GenerateRequest, grpc.ServicerContext], Iterator[pb.GenerateResponse]]


def prompt_len(req: pb.GenerateRequest) -> int:
    return len(req.token_ids.ids) if req.HasField("token_ids") else len(req.text.split())


def tokens(req: pb.GenerateRequest, context: grpc.ServicerContext, delay_s: float = 0.0) -> Iterator[pb.GenerateResponse]:
    """The default behaviour: max_tokens tokens, one per chunk, then FINISH_REASON_LENGTH with usage."""
    n = req.sampling.max_tokens
    for i in range(n):
        if delay_s:
            time.sleep(delay_s)
        msg = pb.GenerateResponse(request_id=req.request_id, token_ids=[300 + i], text=f"t{i} ")
        if req.sampling.logprobs or req.sampling.top_logprobs:
            msg.logprobs.append(pb.TokenLogprob(token_id=300 + i, logprob=-0.5, top=[
                pb.TopLogprob(token_id=300 + i + k, logprob=-0.5 - k) for k in range(req.sampling.top_logprobs)]))
        if i == n - 1:
            msg.finish_reason = pb.FINISH_REASON_LENGTH
            msg.usage.CopyFrom(pb.Usage(prompt_tokens=prompt_len(req), completion_tokens=n, cached_tokens=1))
        yield msg


def failing(code: grpc.StatusCode, message: str, param: str | None = None) -> Handler:
    def handler(req, context):
        if param:
            context.set_trailing_metadata((("tandem-error-param", param),))
        context.abort(code, message)
        yield  # pragma: no cover - a generator, like every handler

    return handler


class FakeRouter:
    def __init__(self, handler: Handler = tokens, models: tuple[pb.ModelInfo, ...] = (),
                 server_credentials: grpc.ServerCredentials | None = None):
        self.handler = handler
        self.models = list(models)
        self.requests: list[pb.GenerateRequest] = []
        self.cancelled: list[str] = []
        self.calls = 0
        self._lock = threading.Lock()
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=16))
        pb_grpc.add_GenerationServicer_to_server(_Servicer(self), self._server)
        if server_credentials is None:
            self.port = self._server.add_insecure_port("127.0.0.1:0")
        else:
            self.port = self._server.add_secure_port("127.0.0.1:0", server_credentials)
        self._server.start()

    @property
    def addr(self) -> str:
        return f"127.0.0.1:{self.port}"

    def wait_cancelled(self, n: int = 1, timeout_s: float = 5.0) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if len(self.cancelled) >= n:
                return True
            time.sleep(0.01)
        return False

    def stop(self) -> None:
        self._server.stop(0).wait()

    def __enter__(self) -> FakeRouter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


class _Servicer(pb_grpc.GenerationServicer):
    def __init__(self, fake: FakeRouter):
        self.fake = fake

    def Generate(self, request, context):
        fake = self.fake
        with fake._lock:
            fake.calls += 1
            fake.requests.append(request)
        try:
            for msg in fake.handler(request, context):
                if not context.is_active():
                    break
                yield msg
        except GeneratorExit:  # grpc closes the handler when the client cancels
            self._cancelled(request)
            raise
        if not context.is_active():
            self._cancelled(request)

    def _cancelled(self, request) -> None:
        with self.fake._lock:
            self.fake.cancelled.append(request.request_id)

    def ListModels(self, request, context):
        return pb.ListModelsResponse(models=self.fake.models)
