"""The request pipeline every generation API shares: edge checks (key, in-flight bound), a `Plan` (the
router calls one request makes), its jobs run on the router, and the outputs collected into one body
or streamed as server-sent events.

Each API (chat_completions.py, completions.py, responses_api.py, messages_api.py) is an `API`: it
parses its own body into a Plan whose `fmt` (a `Format`) writes that API's response body and stream
events, and it writes errors in its own shape. Everything else happens here, once: a streaming
response starts only once the first token (or the first error) is back, so errors keep their HTTP
status; after that an error is written into the stream by the format.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol

from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse

from tandem.services.common import tracing
from tandem.services.gateway.catalog import ModelCatalog, ServedModel
from tandem.services.gateway.chat_template import ChatTemplateError
from tandem.services.gateway.config import GatewayConfig
from tandem.services.gateway.disconnect import ClientDisconnected, EventStream, until_disconnect
from tandem.services.gateway.errors import APIError, bad_request
from tandem.services.gateway.limits import checked, read_body
from tandem.services.gateway.metrics import GatewayMetrics
from tandem.services.gateway.response_store import ResponseStore, open_store
from tandem.services.gateway.responses import Choice, usage
from tandem.services.gateway.router_client import RouterClient
from tandem.services.gateway.structured import Constraint
from tandem.services.gateway.tokenizer import GatewayTokenizer
from tandem.services.gateway.tools import ToolUse, inline_tools, template_renders_tools
from tandem.v1 import generation_pb2

log = logging.getLogger(__name__)

# Longer prompts are tokenized in a thread, so one huge prompt does not stall every other stream.
_INLINE_TOKENIZE_CHARS = 16384

Event = tuple[int, generation_pb2.GenerateResponse]


@dataclass(frozen=True)
class Job:
    """One choice: one Generate call on the router."""

    index: int
    prompt_tokens: int
    request: generation_pb2.GenerateRequest


class Format(Protocol):
    """How one API writes a request's output. Stream methods return framed SSE bytes (maybe none)."""

    def response(self, choices: list[Choice], n: int) -> dict: ...

    def start(self) -> list[bytes]: ...

    def chunk(self, index: int, msg: generation_pb2.GenerateResponse, include_usage: bool) -> list[bytes]: ...

    def end(self, choices: list[Choice], totals: dict, include_usage: bool) -> list[bytes]: ...

    def stream_error(self, err: APIError) -> list[bytes]: ...


@dataclass
class Plan:
    endpoint: str                 # the metrics label
    fmt: Format
    jobs: list[Job]
    n: int
    stream: bool
    include_usage: bool
    constraint: Constraint | None = None
    operation: str = "chat"       # gen_ai.operation.name
    # Runs once the whole output is known, before its last event / body is sent (the Responses API
    # keeps the response there, so a follow-up sent right after the stream ends finds it).
    finish: Callable[[], Awaitable[None]] | None = None

    def explain(self, err: APIError) -> APIError:
        """A worker's 400 about the constraint, renamed to the request's field."""
        return self.constraint.explain(err) if self.constraint is not None else err

    def trace_attributes(self) -> dict:
        """The request's GenAI semantic-convention attributes, for its gateway span."""
        first = self.jobs[0]
        return {"gen_ai.operation.name": self.operation,
                "gen_ai.request.model": first.request.model, "gen_ai.request.choice.count": self.n,
                "gen_ai.request.max_tokens": first.request.sampling.max_tokens,
                "gen_ai.usage.input_tokens": sum(j.prompt_tokens for j in self.jobs[:: max(1, self.n)]),
                "tandem.stream": self.stream, "tandem.request_id": first.request.request_id.rsplit("-", 1)[0]}


class API(Protocol):
    """One HTTP API on the pipeline: `endpoint` labels its metrics and spans; `x_api_key`: the key may
    come in an `x-api-key` header too (Anthropic's clients send it there)."""

    endpoint: str
    path: str
    x_api_key: bool

    async def plan(self, gateway: Gateway, body: bytes) -> Plan: ...

    def error(self, err: APIError) -> Response: ...


class Gateway:
    """Lifecycle: create inside the serving event loop → serve requests → `close()` (idempotent)."""

    def __init__(self, config: GatewayConfig, router: RouterClient | None = None,
                 store: ResponseStore | None = None):
        self.config = config
        self.router = router or RouterClient(config.router, config.request_timeout_s, config.auth)
        self.catalog = ModelCatalog(self.router, config.models_ttl_s, config.tokenizer)
        self.metrics = GatewayMetrics(config.max_inflight)
        self.store = store or open_store(config)
        self.inflight = 0

    async def close(self) -> None:
        await self.router.close()
        await self.store.close()

    # ---- edge checks -------------------------------------------------------------------------

    def authorize(self, request: Request, x_api_key: bool = False) -> None:
        """Bearer auth; `x_api_key`: Anthropic's `x-api-key` header is accepted too."""
        if self.config.api_key is None:
            return
        expected = self.config.api_key.encode()
        scheme, _, key = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() == "bearer" and hmac.compare_digest(key.strip().encode(), expected):
            return
        if x_api_key and hmac.compare_digest(request.headers.get("x-api-key", "").strip().encode(), expected):
            return
        how = "`Authorization: Bearer <key>`" + (" or `x-api-key: <key>`" if x_api_key else "")
        raise APIError(401, f"invalid API key: send {how} with the gateway's --api-key", code="invalid_api_key")

    # ---- the generation pipeline -------------------------------------------------------------

    async def handle(self, request: Request, api: API) -> Response:
        endpoint = api.endpoint
        started = time.monotonic()
        status = 500
        streaming = False
        plan: Plan | None = None
        span = None

        def release(final_status: int) -> None:
            tracing.end(span, {"http.response.status_code": final_status},
                        error=str(final_status) if final_status >= 500 else None)
            self.inflight -= 1
            self.metrics.inflight.dec()
            self.metrics.requests.labels(endpoint, str(final_status)).inc()
            self.metrics.latency.labels(endpoint).observe(time.monotonic() - started)

        try:
            self.authorize(request, x_api_key=api.x_api_key)
        except APIError as e:
            self.metrics.requests.labels(endpoint, str(e.status)).inc()
            return api.error(e)
        if self.inflight >= self.config.max_inflight:
            self.metrics.requests.labels(endpoint, "429").inc()
            return api.error(APIError(429, f"the gateway has {self.inflight} requests in flight "
                                           f"(--max-inflight {self.config.max_inflight}); retry later",
                                      code="rate_limit_exceeded"))
        self.inflight += 1
        self.metrics.inflight.inc()
        # The request's root span (or the child of the caller's `traceparent`); it ends with `release`.
        span = tracing.start(f"POST {api.path}", tracing.extract(request.headers), server=True,
                             attributes={"http.request.method": "POST", "url.path": api.path},
                             start_s=started)
        try:
            body = await read_body(request, self.config.limits.max_request_bytes)
            plan = await api.plan(self, body)
            if span is not None:
                span.set_attributes(plan.trace_attributes())
            with tracing.current(span):   # the router calls start in here and carry the span
                if plan.stream:
                    response = await self._stream(request, plan, started, release)
                    streaming = isinstance(response, EventStream)  # the stream's end releases the slot
                else:
                    response = await until_disconnect(request, self._complete(plan, started))
            status = response.status_code
            return response
        except APIError as e:
            if plan is not None:
                e = plan.explain(e)
            status = e.status
            return api.error(e)
        except ClientDisconnected:
            status = 499
            return Response(status_code=499)
        except Exception as e:  # never a bare traceback to the client
            log.exception("gateway error on %s", api.path)
            return api.error(APIError(500, f"gateway error: {type(e).__name__}: {e}"))
        finally:
            if not streaming:
                release(status)

    async def _complete(self, plan: Plan, started: float) -> JSONResponse:
        first_at: list[float] = []

        async def collect(job: Job) -> Choice:
            choice = Choice(job.index, job.prompt_tokens)
            async with contextlib.aclosing(self.router.generate(job.request)) as stream:
                async for msg in stream:
                    if not first_at:
                        first_at.append(time.monotonic())
                    choice.add(msg)
            return choice

        if len(plan.jobs) == 1:
            choices = [await collect(plan.jobs[0])]
        else:
            tasks = [asyncio.ensure_future(collect(job)) for job in plan.jobs]
            try:
                choices = list(await asyncio.gather(*tasks))
            finally:  # one failed choice (or a gone client) fails the request: stop the others
                for t in tasks:
                    t.cancel()
        if first_at:
            self.metrics.ttft.labels(plan.endpoint).observe(first_at[0] - started)
        body = plan.fmt.response(choices, plan.n)
        self._count(usage(choices, plan.n))
        if plan.finish is not None:
            await plan.finish()
        return JSONResponse(body)

    async def _stream(self, request: Request, plan: Plan, started: float,
                      release: Callable[[int], None]) -> Response:
        events = _events(self.router, plan.jobs)

        async def first_event():
            return await anext(events, None)

        try:
            first = await until_disconnect(request, first_event())
        except BaseException:
            await events.aclose()
            raise
        status = [499]  # what the stream ended with; stays 499 unless it runs to its end

        async def on_close() -> None:
            with contextlib.suppress(RuntimeError):  # still running: it is closing as its cancellation unwinds
                await events.aclose()
            release(status[0])

        return EventStream(self._sse(plan, events, first, started, status), on_close)

    async def _sse(self, plan: Plan, events: AsyncIterator[Event], first: Event | None, started: float,
                   status: list[int]) -> AsyncIterator[bytes]:
        choices = {job.index: Choice(job.index, job.prompt_tokens) for job in plan.jobs}
        fmt = plan.fmt
        try:
            for frame in fmt.start():
                yield frame
            if first is not None:
                self.metrics.ttft.labels(plan.endpoint).observe(time.monotonic() - started)
                index, msg = first
                choices[index].track(msg)
                for frame in fmt.chunk(index, msg, plan.include_usage):
                    yield frame
                async for index, msg in events:
                    choices[index].track(msg)
                    for frame in fmt.chunk(index, msg, plan.include_usage):
                        yield frame
            done = list(choices.values())
            totals = usage(done, plan.n)
            self._count(totals)
            tail = fmt.end(done, totals, plan.include_usage)
            if plan.finish is not None:
                await plan.finish()
            for frame in tail:
                yield frame
            status[0] = 200
        except APIError as e:  # after the first chunk the status line is gone: report in band
            e = plan.explain(e)
            status[0] = e.status
            for frame in fmt.stream_error(e):
                yield frame

    def _count(self, totals: dict) -> None:
        self.metrics.prompt_tokens.inc(totals["prompt_tokens"])
        self.metrics.completion_tokens.inc(totals["completion_tokens"])

    # ---- models ------------------------------------------------------------------------------

    async def list_models(self) -> dict:
        return {"object": "list", "data": [self._model_card(m) for m in await self.catalog.models()]}

    async def get_model(self, model_id: str) -> dict:
        return self._model_card(await self.catalog.get(model_id))

    def _model_card(self, m: ServedModel) -> dict:
        """OpenAI's model object, with vLLM's `root` / `parent` (a LoRA adapter: its base model)."""
        return {"id": m.id, "object": "model", "created": self.catalog.created, "owned_by": "tandem",
                "root": m.parent or m.id, "parent": m.parent or None, "max_model_len": m.max_context_len}


def add_post(app: FastAPI, gateway: Gateway, api: API) -> None:
    """The API's generation route: `POST api.path` through the pipeline."""
    async def create(request: Request) -> Response:
        return await gateway.handle(request, api)

    app.add_api_route(api.path, create, methods=["POST"], name=api.endpoint)


def owned_by(api: API, path: str) -> bool:
    """Whether `path` is one of the API's (its errors are then in the API's shape)."""
    return path == api.path or path.startswith(api.path + "/")


# ---- what the APIs build their plans from ----------------------------------------------------------

async def encode(tok: GatewayTokenizer, text: str, add_special_tokens: bool) -> list[int]:
    if len(text) > _INLINE_TOKENIZE_CHARS:
        return await asyncio.to_thread(tok.encode, text, add_special_tokens)
    return tok.encode(text, add_special_tokens)


def with_tools(messages: list[dict], tools: ToolUse | None, template: str | None,
               kwargs: dict | None) -> tuple[list[dict], dict | None]:
    """The messages and template variables with the offered tools and the history's calls and results:
    through the template's own `tools` where it renders them as the parser reads them, else written
    into the messages (tools.py)."""
    offered = tools.tools if tools is not None and tools.offered else ()
    if template_renders_tools(template):
        return messages, ({**(kwargs or {}), "tools": [t.spec() for t in offered]} if offered else kwargs)
    if offered or any(m.get("tool_calls") or m["role"] in ("tool", "function") for m in messages):
        return inline_tools(messages, offered), kwargs
    return messages, kwargs


async def chat_prompt(gateway: Gateway, model: ServedModel, messages: list[dict], tools: ToolUse | None,
                      param: str, kwargs: dict | None = None, add_generation_prompt: bool = True) -> list[int]:
    """Chat messages (OpenAI's shape, tool calls and results included) → the prompt's token ids,
    through the model's chat template; a template that refuses them or a prompt too long is a 400
    naming `param`."""
    messages, extra = with_tools(messages, tools, model.tokenizer.chat_template, kwargs)
    try:
        text = model.tokenizer.apply_chat_template(messages, add_generation_prompt, extra)
    except (ChatTemplateError, ValueError) as e:
        raise bad_request(str(e), param) from None
    # The template already holds the special tokens it wants (as Hugging Face tokenizes chats).
    ids = await encode(model.tokenizer, text, add_special_tokens=False)
    checked(gateway.config.limits.check_prompt_tokens, len(ids), param)
    return ids


def max_tokens_for(model: ServedModel, prompt_len: int, requested: int | None, prompt_param: str,
                   param: str) -> int:
    """The request's max_tokens; None means "what the context has room for"."""
    ctx = model.max_context_len
    if ctx and prompt_len >= ctx:
        raise bad_request(f"the prompt has {prompt_len} tokens; this model's context length is {ctx}", prompt_param)
    if requested is None:
        if not ctx:
            raise bad_request(f"{param} is required (the model's context length is unknown)", param)
        return ctx - prompt_len
    if ctx and prompt_len + requested > ctx:
        raise bad_request(f"the prompt ({prompt_len} tokens) + {param} ({requested}) exceeds this model's "
                          f"context length {ctx}", param)
    return requested


def make_jobs(rid: str, model: ServedModel, ids: list[int], sampling, prompt_index: int = 0, n: int = 1,
              priority: int = 0) -> list[Job]:
    jobs = []
    for i in range(n):
        index = prompt_index * n + i
        req = generation_pb2.GenerateRequest(request_id=f"{rid}-{index}", model=model.id,
                                             token_ids=generation_pb2.TokenIds(ids=ids), sampling=sampling.to_pb(i),
                                             priority=priority)
        jobs.append(Job(index, len(ids), req))
    return jobs


async def _events(router: RouterClient, jobs: list[Job]) -> AsyncIterator[Event]:
    """Every job's chunks as (choice index, chunk), in arrival order; the first failure fails them all."""
    if len(jobs) == 1:
        async with contextlib.aclosing(router.generate(jobs[0].request)) as stream:
            async for msg in stream:
                yield jobs[0].index, msg
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(job: Job) -> None:
        try:
            async with contextlib.aclosing(router.generate(job.request)) as stream:
                async for msg in stream:
                    queue.put_nowait((job.index, msg))
            queue.put_nowait((job.index, None))
        except Exception as e:
            queue.put_nowait((job.index, e))

    tasks = [asyncio.ensure_future(pump(job)) for job in jobs]
    try:
        remaining = len(jobs)
        while remaining:
            index, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield index, item
    finally:
        for t in tasks:
            t.cancel()
