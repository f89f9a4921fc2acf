"""Test doubles for the harness: a fake `tandem.v1.Generation` server, a fake OpenAI HTTP server and a
tiny BPE tokenizer."""

from __future__ import annotations

import json
import random
import threading
import time
from collections.abc import Callable
from concurrent import futures
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import grpc
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from tandem.v1 import generation_pb2, generation_pb2_grpc

WORDS = ("alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november oscar papa "
         "quebec romeo sierra tango uniform victor whiskey xray yankee zulu red green blue cyan magenta "
         "yellow black white orange purple brown river mountain forest desert ocean island valley canyon "
         "meadow glacier volcano harbor bridge tower castle garden market temple palace station library "
         "museum theater stadium airport factory school hospital bakery kitchen bedroom window ceiling "
         "carpet mirror candle pillow blanket basket bottle hammer ladder rocket planet comet galaxy "
         "nebula meteor saturn jupiter mercury venus neptune pluto silver golden copper iron zinc tin").split()


def byte_level_bpe(vocab_size: int = 700) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    rng = random.Random(0)
    corpus = [" ".join(rng.choice(WORDS) for _ in range(40)) for _ in range(200)]
    tok.train_from_iterator(corpus, trainer)
    return tok


class FakeGeneration(generation_pb2_grpc.GenerationServicer):
    """Streams `max_tokens` one-token chunks `gap` s apart; the text prompt "bad" is rejected."""

    def __init__(self, gap: float = 0.01):
        self.gap = gap
        self.requests: list[generation_pb2.GenerateRequest] = []

    def Generate(self, request, context):
        self.requests.append(request)
        if request.HasField("text") and request.text == "bad":
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "prompt is bad")
        n = request.sampling.max_tokens
        for i in range(n):
            time.sleep(self.gap)
            last = i == n - 1
            yield generation_pb2.GenerateResponse(
                token_ids=[100 + i], text=f" t{i}",
                finish_reason=generation_pb2.FINISH_REASON_LENGTH if last else 0,
                usage=generation_pb2.Usage(prompt_tokens=2, completion_tokens=n) if last else None)


class FakeServer:
    """A thread-pool gRPC server with FakeGeneration on 127.0.0.1; use as a context manager."""

    def __init__(self, gap: float = 0.01):
        self.servicer = FakeGeneration(gap)
        self.server = grpc.server(futures.ThreadPoolExecutor(16))
        generation_pb2_grpc.add_GenerationServicer_to_server(self.servicer, self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")

    def __enter__(self) -> FakeServer:
        self.server.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.stop(None)


class FakeOpenAIServer:
    """Streaming /v1/completions and /v1/chat/completions on 127.0.0.1 (SSE, then a usage chunk and
    [DONE]): `max_tokens` chunks `gap` s apart, " a{n}w{i}" for the n-th request, so every answer is
    unique. A request `fail(body)` is true of gets HTTP 500. `bodies` holds every request body, in
    arrival order. Use as a context manager."""

    def __init__(self, gap: float = 0.002, fail: Callable[[dict], bool] = lambda body: False):
        self.gap, self.fail = gap, fail
        self.bodies: list[dict] = []
        self._lock = threading.Lock()
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                chat = self.path == "/v1/chat/completions"
                if not chat and self.path != "/v1/completions":
                    self.send_error(404)
                    return
                with fake._lock:
                    n = len(fake.bodies)
                    fake.bodies.append(body)
                if fake.fail(body):
                    self.send_error(500, "told to fail")
                    return
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.end_headers()
                if chat:
                    self._event({"choices": [{"index": 0, "delta": {"role": "assistant"}}]})
                for i in range(body["max_tokens"]):
                    time.sleep(fake.gap)
                    piece = f" a{n}w{i}"
                    self._event({"choices": [{"index": 0, "delta": {"content": piece}} if chat
                                             else {"index": 0, "text": piece}]})
                self._event({"choices": [], "usage": {"prompt_tokens": 1, "completion_tokens": body["max_tokens"]}})
                self.wfile.write(b"data: [DONE]\n\n")

            def _event(self, data: dict) -> None:
                self.wfile.write(f"data: {json.dumps(data)}\n\n".encode())
                self.wfile.flush()

            def log_message(self, *a):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> FakeOpenAIServer:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()
