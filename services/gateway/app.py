"""The gateway's HTTP API (FastAPI): OpenAI completions, chat completions and models; health; metrics.

A request is parsed and checked at the edge (400 naming the parameter), its prompt tokenized here
(the router gets token ids), and each of its choices becomes one `Generate` call on the router. A
streaming response starts only once the first token (or the first error) is back, so errors keep
their HTTP status; after that an error becomes an in-band `error` event before `data: [DONE]`.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from fastapi import FastAPI, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from tandem.services.common import tracing
from tandem.services.gateway.catalog import ModelCatalog, ServedModel
from tandem.services.gateway.chat_template import ChatTemplateError
from tandem.services.gateway.config import GatewayConfig
from tandem.services.gateway.disconnect import ClientDisconnected, EventStream, until_disconnect
from tandem.services.gateway.errors import APIError, bad_request
from tandem.services.gateway.limits import checked, read_body
from tandem.services.gateway.lora_admin import add_lora_admin_routes
from tandem.services.gateway.metrics import GatewayMetrics
from tandem.services.gateway.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    chat_messages,
    check_common,
    check_completion,
    completion_prompts,
    make_sampling,
    output_constraint,
    parse,
    tool_use,
)
from tandem.services.gateway.responses import SSE_DONE, ChatFormat, Choice, CompletionFormat, sse, usage
from tandem.services.gateway.router_client import RouterClient
from tandem.services.gateway.structured import Constraint
from tandem.services.gateway.tokenizer import GatewayTokenizer
from tandem.services.gateway.tools import ToolUse, inline_tools, template_renders_tools
from tandem.v1 import generation_pb2

log = logging.getLogger(__name__)

# Longer prompts are tokenized in a thread, so one huge prompt does not stall every other stream.
_INLINE_TOKENIZE_CHARS = 16384


@dataclass(frozen=True)
class Job:
    """One choice: one Generate call on the router."""

    index: int
    prompt_tokens: int
    request: generation_pb2.GenerateRequest


@dataclass
class Plan:
    endpoint: str
    fmt: CompletionFormat
    jobs: list[Job]
    n: int
    stream: bool
    include_usage: bool
    constraint: Constraint | None = None

    def explain(self, err: APIError) -> APIError:
        """A worker's 400 about the constraint, renamed to the request's field."""
        return self.constraint.explain(err) if self.constraint is not None else err

    def trace_attributes(self) -> dict:
        """The request's GenAI semantic-convention attributes, for its gateway span."""
        first = self.jobs[0]
        return {"gen_ai.operation.name": "chat" if self.endpoint == "chat" else "text_completion",
                "gen_ai.request.model": first.request.model, "gen_ai.request.choice.count": self.n,
                "gen_ai.request.max_tokens": first.request.sampling.max_tokens,
                "gen_ai.usage.input_tokens": sum(j.prompt_tokens for j in self.jobs[:: max(1, self.n)]),
                "tandem.stream": self.stream, "tandem.request_id": first.request.request_id.rsplit("-", 1)[0]}


class Gateway:
    """Lifecycle: create inside the serving event loop → serve requests → `close()` (idempotent)."""

    def __init__(self, config: GatewayConfig, router: RouterClient | None = None):
        self.config = config
        self.router = router or RouterClient(config.router, config.request_timeout_s, config.auth)
        self.catalog = ModelCatalog(self.router, config.models_ttl_s, config.tokenizer)
        self.metrics = GatewayMetrics(config.max_inflight)
        self.inflight = 0

    async def close(self) -> None:
        await self.router.close()

    # ---- edge checks -------------------------------------------------------------------------

    def authorize(self, request: Request) -> None:
        if self.config.api_key is None:
            return
        scheme, _, key = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(key.strip().encode(), self.config.api_key.encode()):
            raise APIError(401, "invalid API key: send `Authorization: Bearer <key>` with the gateway's --api-key",
                           code="invalid_api_key")

    # ---- generation endpoints ----------------------------------------------------------------

    async def handle(self, request: Request, endpoint: str) -> Response:
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
            self.authorize(request)
        except APIError as e:
            self.metrics.requests.labels(endpoint, str(e.status)).inc()
            return e.response()
        if self.inflight >= self.config.max_inflight:
            self.metrics.requests.labels(endpoint, "429").inc()
            return APIError(429, f"the gateway has {self.inflight} requests in flight "
                                 f"(--max-inflight {self.config.max_inflight}); retry later",
                            code="rate_limit_exceeded").response()
        self.inflight += 1
        self.metrics.inflight.inc()
        # The request's root span (or the child of the caller's `traceparent`); it ends with `release`.
        span = tracing.start(f"POST /v1/{endpoint}", tracing.extract(request.headers), server=True,
                             attributes={"http.request.method": "POST", "url.path": f"/v1/{endpoint}"},
                             start_s=started)
        try:
            body = await read_body(request, self.config.limits.max_request_bytes)
            plan = await (self._plan_completion(body) if endpoint == "completions" else self._plan_chat(body))
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
            return e.response()
        except ClientDisconnected:
            status = 499
            return Response(status_code=499)
        except Exception as e:  # never a bare traceback to the client
            log.exception("gateway error on /v1/%s", endpoint)
            return APIError(500, f"gateway error: {type(e).__name__}: {e}").response()
        finally:
            if not streaming:
                release(status)

    async def _plan_completion(self, body: bytes) -> Plan:
        req = parse(CompletionRequest, body)
        check_common(req, self.config.max_n)
        check_completion(req)
        limits = self.config.limits
        checked(limits.check_stop, req.stop)
        checked(limits.check_max_tokens, req.max_tokens)
        prompts = completion_prompts(req)
        constraint = output_constraint(req)
        model = await self.catalog.get(req.model)
        rid = f"cmpl-{uuid.uuid4().hex}"
        jobs = []
        for p_index, prompt in enumerate(prompts):
            if isinstance(prompt, str):
                ids = await _encode(model.tokenizer, prompt, add_special_tokens=True)
            else:
                ids = prompt
                if model.vocab_size and any(not 0 <= t < model.vocab_size for t in ids):
                    raise bad_request(f"prompt token ids must be in [0, {model.vocab_size})", "prompt")
            checked(limits.check_prompt_tokens, len(ids))
            max_tokens = _max_tokens(model, len(ids), req.max_tokens, "prompt", "max_tokens")
            sampling = make_sampling(req, max_tokens, logprobs=req.logprobs is not None,
                                     top_logprobs=req.logprobs or 0, defaults=model.sampling, constraint=constraint)
            jobs += _jobs(rid, model, ids, sampling, p_index, req.n, req.priority or 0)
        fmt = CompletionFormat(rid, int(time.time()), model.id, model.tokenizer, req.logprobs)
        return Plan("completions", fmt, jobs, req.n, req.stream, req.include_usage, constraint)

    async def _plan_chat(self, body: bytes) -> Plan:
        req = parse(ChatCompletionRequest, body)
        check_common(req, self.config.max_n)
        limits = self.config.limits
        max_param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        requested = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        checked(limits.check_stop, req.stop)
        checked(limits.check_max_tokens, requested, max_param)
        if req.top_logprobs and not req.logprobs:
            raise bad_request("top_logprobs requires logprobs: true", "top_logprobs")
        tools = tool_use(req)
        constraint = output_constraint(req, tools)
        messages = chat_messages(req)
        model = await self.catalog.get(req.model)
        messages, extra = _with_tools(messages, tools, model.tokenizer.chat_template, req.chat_template_kwargs)
        try:
            text = model.tokenizer.apply_chat_template(messages, req.add_generation_prompt, extra)
        except (ChatTemplateError, ValueError) as e:
            raise bad_request(str(e), "messages") from None
        # The template already holds the special tokens it wants (as Hugging Face tokenizes chats).
        ids = await _encode(model.tokenizer, text, add_special_tokens=False)
        checked(limits.check_prompt_tokens, len(ids), "messages")
        max_tokens = _max_tokens(model, len(ids), requested, "messages", max_param)
        sampling = make_sampling(req, max_tokens, logprobs=req.logprobs, top_logprobs=req.top_logprobs or 0,
                                 defaults=model.sampling, max_tokens_param=max_param, constraint=constraint)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        fmt = ChatFormat(rid, int(time.time()), model.id, model.tokenizer, req.logprobs,
                         tool_calls=tools is not None and tools.offered, reasoning=self.config.reasoning_parser)
        return Plan("chat", fmt, _jobs(rid, model, ids, sampling, 0, req.n, req.priority or 0), req.n, req.stream,
                    req.include_usage, constraint)

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
        self._count(body["usage"])
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

    async def _sse(self, plan: Plan, events: AsyncIterator[tuple[int, generation_pb2.GenerateResponse]],
                   first: tuple[int, generation_pb2.GenerateResponse] | None, started: float,
                   status: list[int]) -> AsyncIterator[bytes]:
        choices = {job.index: Choice(job.index, job.prompt_tokens) for job in plan.jobs}
        try:
            if first is not None:
                self.metrics.ttft.labels(plan.endpoint).observe(time.monotonic() - started)
                index, msg = first
                choices[index].track(msg)
                if (chunk := plan.fmt.chunk(index, msg, plan.include_usage)) is not None:
                    yield sse(chunk)
                async for index, msg in events:
                    choices[index].track(msg)
                    if (chunk := plan.fmt.chunk(index, msg, plan.include_usage)) is not None:
                        yield sse(chunk)
            totals = usage(list(choices.values()), plan.n)
            self._count(totals)
            if plan.include_usage:
                yield sse(plan.fmt.usage_chunk(totals))
            yield SSE_DONE
            status[0] = 200
        except APIError as e:  # after the first chunk the status line is gone: report in band
            e = plan.explain(e)
            status[0] = e.status
            yield sse(e.body())
            yield SSE_DONE

    def _count(self, totals: dict) -> None:
        self.metrics.prompt_tokens.inc(totals["prompt_tokens"])
        self.metrics.completion_tokens.inc(totals["completion_tokens"])

    # ---- models, health ----------------------------------------------------------------------

    async def list_models(self) -> dict:
        return {"object": "list", "data": [self._model_card(m) for m in await self.catalog.models()]}

    async def get_model(self, model_id: str) -> dict:
        return self._model_card(await self.catalog.get(model_id))

    def _model_card(self, m: ServedModel) -> dict:
        """OpenAI's model object, with vLLM's `root` / `parent` (a LoRA adapter: its base model)."""
        return {"id": m.id, "object": "model", "created": self.catalog.created, "owned_by": "tandem",
                "root": m.parent or m.id, "parent": m.parent or None, "max_model_len": m.max_context_len}


async def _encode(tok: GatewayTokenizer, text: str, add_special_tokens: bool) -> list[int]:
    if len(text) > _INLINE_TOKENIZE_CHARS:
        return await asyncio.to_thread(tok.encode, text, add_special_tokens)
    return tok.encode(text, add_special_tokens)


def _with_tools(messages: list[dict], tools: ToolUse | None, template: str | None,
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


def _max_tokens(model: ServedModel, prompt_len: int, requested: int | None, prompt_param: str, param: str) -> int:
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


def _jobs(rid: str, model: ServedModel, ids: list[int], sampling, prompt_index: int, n: int,
          priority: int) -> list[Job]:
    jobs = []
    for i in range(n):
        index = prompt_index * n + i
        req = generation_pb2.GenerateRequest(request_id=f"{rid}-{index}", model=model.id,
                                             token_ids=generation_pb2.TokenIds(ids=ids), sampling=sampling.to_pb(i),
                                             priority=priority)
        jobs.append(Job(index, len(ids), req))
    return jobs


async def _events(router: RouterClient, jobs: list[Job]) -> AsyncIterator[tuple[int, generation_pb2.GenerateResponse]]:
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


def create_app(gateway: Gateway) -> FastAPI:
    app = FastAPI(title="Tandem gateway", description="OpenAI-compatible API in front of the Tandem router")
    app.state.gateway = gateway

    @app.exception_handler(APIError)
    async def _api_error(_request: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return APIError.from_http(exc.status_code, str(exc.detail), request.method, request.url.path,
                                  exc.headers).response()

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_request: Request, exc: RequestValidationError) -> JSONResponse:
        return bad_request(str(exc)).response()

    @app.exception_handler(Exception)
    async def _unexpected(_request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled gateway error")
        return APIError(500, f"gateway error: {type(exc).__name__}: {exc}").response()

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await gateway.handle(request, "completions")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await gateway.handle(request, "chat")

    @app.get("/v1/models")
    async def models(request: Request) -> dict:
        gateway.authorize(request)
        return await gateway.list_models()

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str, request: Request) -> dict:
        gateway.authorize(request)
        return await gateway.get_model(model_id)

    add_lora_admin_routes(app, gateway)   # POST /v1/load_lora_adapter, /v1/unload_lora_adapter (opt-in)

    @app.get("/health")
    async def health() -> Response:
        if await gateway.router.serving():
            return JSONResponse({"status": "ok"})
        return APIError(503, f"router {gateway.router.addr} is unreachable or has no workers to route to").response()

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(gateway.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return app
