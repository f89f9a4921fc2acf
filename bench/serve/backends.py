"""Ways to send a `BenchRequest` and time its stream: a small registry of client backends.

    "openai-http"  any OpenAI-compatible server: streaming /v1/completions (or /v1/chat/completions)
                   with `stream_options.include_usage`; token events are SSE chunk arrivals.
    "tandem-grpc"  Tandem's router: `tandem.v1.Generation.Generate` server stream; token events are
                   response messages, token counts are exact (each message lists its token ids).

A backend never raises for a failed request: it returns the record with `success=False` and the
server's message, so one bad request does not end a benchmark.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from tandem.bench.serve.records import BenchRequest, RequestRecord

# How a backend makes the server produce exactly `output_len` tokens (EOS would end some early):
#   ignore-eos            {"ignore_eos": true}          (vLLM / SGLang / Tandem convention)
#   min-tokens            {"min_tokens": N}             (vLLM)
#   hf-generation-config  {"generation_config": "{\"min_new_tokens\": N}"} (`transformers serve`)
#   off                   nothing: outputs may end early at EOS
FORCE_OUTPUT_LEN = ("ignore-eos", "min-tokens", "hf-generation-config", "off")


@dataclass(frozen=True)
class BackendConfig:
    base_url: str                        # http://host:port for openai-http, host:port for tandem-grpc
    model: str = ""                      # model name sent with each request ("" = server's default)
    endpoint: str = "/v1/completions"
    temperature: float = 0.0
    force_output_len: str = "ignore-eos"
    extra_body: dict = field(default_factory=dict)  # merged into every HTTP request body
    timeout_s: float = 600.0
    use_token_ids: bool = True           # tandem-grpc: send the dataset's exact token ids when known
    api_key: str | None = None           # sent as `Authorization: Bearer KEY` (HTTP header / gRPC metadata)


class Backend(Protocol):
    async def start(self) -> None: ...

    async def send(self, req: BenchRequest) -> RequestRecord: ...

    async def close(self) -> None: ...


def http_url(base_url: str) -> str:
    """'host:port' or 'http://host:port/' -> 'http://host:port'."""
    base = base_url.rstrip("/")
    return base if "://" in base else "http://" + base


def _error_text(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}".strip()[:500] or type(e).__name__


class OpenAIHTTPBackend:
    def __init__(self, cfg: BackendConfig):
        if cfg.force_output_len not in FORCE_OUTPUT_LEN:
            raise ValueError(f"force_output_len must be one of {FORCE_OUTPUT_LEN}")
        self.cfg = cfg
        self.chat = cfg.endpoint.rstrip("/").endswith("chat/completions")
        self.url = http_url(cfg.base_url) + cfg.endpoint
        self._client = None

    async def start(self) -> None:
        import httpx

        if self._client is not None:
            return  # a client given by the caller (tests pass one with a mock transport)
        headers = {"Authorization": f"Bearer {self.cfg.api_key}"} if self.cfg.api_key else {}
        self._client = httpx.AsyncClient(
            headers=headers, timeout=httpx.Timeout(self.cfg.timeout_s, connect=30.0),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=None),
        )

    async def close(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    def body(self, req: BenchRequest) -> dict:
        body: dict = {"model": req.model or self.cfg.model, "max_tokens": req.output_len,
                      "temperature": self.cfg.temperature, "stream": True, "stream_options": {"include_usage": True}}
        if self.chat:
            history = req.messages if req.messages is not None else (("user", req.prompt),)
            body["messages"] = [{"role": role, "content": content} for role, content in history]
        else:
            body["prompt"] = req.prompt
        mode = self.cfg.force_output_len
        if mode == "ignore-eos":
            body["ignore_eos"] = True
        elif mode == "min-tokens":
            body["min_tokens"] = req.output_len
        elif mode == "hf-generation-config":
            body["generation_config"] = json.dumps({"min_new_tokens": req.output_len})
        if req.priority is not None:
            body["priority"] = req.priority  # Tandem's gateway, vLLM and SGLang all take it here
        body.update(self.cfg.extra_body)
        return body

    async def send(self, req: BenchRequest) -> RequestRecord:
        assert self._client is not None, "start() the backend first"
        rec = RequestRecord(prompt_len=req.prompt_len, output_len=req.output_len, priority=req.priority)
        events = 0
        usage_tokens: int | None = None
        rec.start = time.perf_counter()
        try:
            async with self._client.stream("POST", self.url, json=self.body(req)) as resp:
                if resp.status_code != 200:
                    detail = (await resp.aread()).decode(errors="replace")[:300]
                    rec.error = f"HTTP {resp.status_code}: {detail}"
                    return rec
                async for line in resp.aiter_lines():
                    now = time.perf_counter()
                    if not line.startswith("data:"):
                        continue  # blank separators, comments, event: lines
                    payload = line[5:].strip()
                    if payload == "[DONE]":
                        break
                    data = json.loads(payload)
                    if data.get("error"):
                        err = data["error"]
                        rec.error = str(err.get("message", err) if isinstance(err, dict) else err)[:500]
                        return rec
                    if self._is_token_event(data):
                        rec.token_times.append(now)
                        events += 1
                    rec.output_text += self._text(data)
                    usage = data.get("usage")
                    if usage and usage.get("completion_tokens") is not None:
                        usage_tokens = int(usage["completion_tokens"])
                    if usage and (usage.get("prompt_tokens_details") or {}).get("cached_tokens") is not None:
                        rec.cached_tokens = int(usage["prompt_tokens_details"]["cached_tokens"])
            rec.output_tokens = usage_tokens if usage_tokens is not None else events
            if not rec.token_times:
                rec.error = "the stream ended without any output"
            else:
                rec.success = True
        except Exception as e:  # any transport failure fails this request only
            rec.error = _error_text(e)
        finally:
            rec.end = time.perf_counter()
        return rec

    def _text(self, data: dict) -> str:
        choices = data.get("choices") or []
        if not choices:
            return ""
        c = choices[0]
        return ((c.get("delta") or {}).get("content") if self.chat else c.get("text")) or ""

    def _is_token_event(self, data: dict) -> bool:
        """A chunk with generated output. Text may be empty for a token whose characters are held
        back; an empty chunk that only carries finish_reason is a terminator, not a token."""
        choices = data.get("choices") or []
        if not choices:
            return False
        c = choices[0]
        if self._text(data):
            return True
        if self.chat and "role" in (c.get("delta") or {}):
            return False  # the opening role-only chunk
        return not c.get("finish_reason")


class TandemGrpcBackend:
    def __init__(self, cfg: BackendConfig):
        self.cfg = cfg
        self.target = cfg.base_url.removeprefix("grpc://").rstrip("/")
        self._channel = None
        self._stub = None

    async def start(self) -> None:
        import grpc

        from tandem.v1 import generation_pb2_grpc

        self._channel = grpc.aio.insecure_channel(self.target)
        self._stub = generation_pb2_grpc.GenerationStub(self._channel)

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close()
            self._channel = None

    def request(self, req: BenchRequest):
        from tandem.v1 import generation_pb2

        sampling = generation_pb2.SamplingParams(max_tokens=req.output_len, temperature=self.cfg.temperature,
                                                 ignore_eos=self.cfg.force_output_len != "off")
        msg = generation_pb2.GenerateRequest(model=req.model or self.cfg.model, sampling=sampling, priority=req.priority or 0)
        if self.cfg.use_token_ids and req.prompt_ids is not None:
            msg.token_ids.ids.extend(req.prompt_ids)
        else:
            msg.text = req.prompt
        return msg

    async def send(self, req: BenchRequest) -> RequestRecord:
        import grpc

        assert self._stub is not None, "start() the backend first"
        rec = RequestRecord(prompt_len=req.prompt_len, output_len=req.output_len, priority=req.priority)
        msg = self.request(req)
        rec.start = time.perf_counter()
        try:
            auth = (("authorization", f"Bearer {self.cfg.api_key}"),) if self.cfg.api_key else None
            call = self._stub.Generate(msg, timeout=self.cfg.timeout_s, metadata=auth)
            while True:
                resp = await call.read()
                now = time.perf_counter()
                if resp is grpc.aio.EOF:
                    break
                if resp.token_ids:
                    rec.token_times.append(now)
                    rec.output_tokens += len(resp.token_ids)
                rec.output_text += resp.text
                if resp.HasField("usage"):
                    rec.cached_tokens = resp.usage.cached_tokens
            if not rec.token_times:
                rec.error = "the stream ended without any output"
            else:
                rec.success = True
        except grpc.aio.AioRpcError as e:
            rec.error = f"{e.code().name}: {e.details()}"
        except asyncio.CancelledError:
            raise
        except Exception as e:  # any transport failure fails this request only
            rec.error = _error_text(e)
        finally:
            rec.end = time.perf_counter()
        return rec


BACKENDS: dict[str, Callable[[BackendConfig], Backend]] = {
    "openai-http": OpenAIHTTPBackend,
    "tandem-grpc": TandemGrpcBackend,
}

DEFAULT_URLS = {"openai-http": "http://127.0.0.1:8000", "tandem-grpc": "127.0.0.1:50051"}


def make_backend(name: str, cfg: BackendConfig) -> Backend:
    if name not in BACKENDS:
        raise ValueError(f"unknown backend {name!r}; choose one of {', '.join(BACKENDS)}")
    return BACKENDS[name](cfg)
