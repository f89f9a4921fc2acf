"""OpenAI's Responses API on the shared pipeline: `POST /v1/responses` (whole or streamed), and
`GET` / `DELETE /v1/responses/{id}`, `POST /v1/responses/{id}/cancel`, `GET .../input_items` over the
response store (response_store.py).

A response's output items are the model's output blocks (blocks.py): `reasoning` (with a
`--reasoning-parser`), `message` (output_text) and `function_call`. A stream is the event sequence
the official client accumulates: response.created, response.in_progress, then per item
output_item.added → (content_part.added → deltas → *.done → content_part.done) → output_item.done,
and response.completed (response.incomplete when max_output_tokens cut it), each with its
sequence_number. A follow-up (`previous_response_id`) is prompted with the whole conversation.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse

from tandem.services.gateway.blocks import Block, BlockEvent, OutputBlocks, whole
from tandem.services.gateway.errors import APIError, bad_request
from tandem.services.gateway.limits import checked
from tandem.services.gateway.pipeline import Gateway, Plan, add_post, chat_prompt, make_jobs, max_tokens_for
from tandem.services.gateway.protocol import check_priority_field, make_sampling, parse
from tandem.services.gateway.responses import Choice, finish_reason, sse_event, usage
from tandem.services.gateway.responses_items import (
    ResponsesRequest,
    check_request,
    format_echo,
    input_messages,
    new_id,
    output_message,
    text_format,
    tool_use,
)
from tandem.services.gateway.structured import after_thinking
from tandem.services.gateway.tokenizer import GatewayTokenizer
from tandem.services.gateway.tool_formats import parser_for
from tandem.v1 import generation_pb2

_ITEM_PREFIX = {"text": "msg", "reasoning": "rs", "tool_call": "fc"}


def not_found(rid: str) -> APIError:
    return APIError(404, f"Response with id {rid!r} not found.", "response_id", "not_found")


class ResponsesFormat:
    """One response: its body (`response`), or its stream events (`start`, `chunk`, `end`)."""

    def __init__(self, head: dict, tokenizer: GatewayTokenizer, reasoning: str | None,
                 tools: Callable[[], Any] | None):
        self.head = head                  # the response object's fields other than output/status/usage
        self.tokenizer = tokenizer
        self.reasoning, self.tools = reasoning, tools
        self.blocks = OutputBlocks(reasoning, tools)
        self._ids: dict[int, str] = {}
        self._seq = 0
        self._finished = False
        self._cut = False                 # max_output_tokens ended the output: its last item is incomplete
        self.result: dict | None = None   # the final response object, once known
        self.output_blocks: list[Block] = []

    # ---- the response object --------------------------------------------------------------------

    def _id(self, index: int, block: Block) -> str:
        return self._ids.setdefault(index, new_id(_ITEM_PREFIX[block.kind]))

    def _item(self, index: int, block: Block, done: bool) -> dict:
        # As OpenAI's: the item the limit cut short says so, so that a client never runs a call (or
        # shows a message) whose text stops mid-way as if it were whole.
        cut = self._cut and index == len(self.blocks.blocks) - 1
        status = ("incomplete" if cut else "completed") if done else "in_progress"
        item_id = self._id(index, block)
        if block.kind == "text":
            content = [_text_part(block.text)] if done else []
            return {"type": "message", "id": item_id, "status": status, "role": "assistant", "content": content}
        if block.kind == "reasoning":
            content = [{"type": "reasoning_text", "text": block.text}] if done else []
            return {"type": "reasoning", "id": item_id, "status": status, "summary": [], "content": content}
        return {"type": "function_call", "id": item_id, "status": status, "call_id": block.call_id,
                "name": block.name, "arguments": block.text if done else ""}

    def _body(self, status: str, blocks: list[Block], choice: Choice | None, totals: dict | None) -> dict:
        body = {**self.head, "status": status, "output": [self._item(i, b, True) for i, b in enumerate(blocks)],
                "incomplete_details": None, "usage": None}
        if choice is not None and choice.finish_reason == "length":
            body["status"] = "incomplete"
            body["incomplete_details"] = {"reason": "max_output_tokens"}
        if totals is not None:
            thought = "".join(b.text for b in blocks if b.kind == "reasoning")
            body["usage"] = {
                "input_tokens": totals["prompt_tokens"],
                "input_tokens_details": {"cached_tokens": totals["prompt_tokens_details"]["cached_tokens"]},
                "output_tokens": totals["completion_tokens"],
                "output_tokens_details": {"reasoning_tokens": len(self.tokenizer.encode(thought, False)) if thought
                                          else 0},
                "total_tokens": totals["total_tokens"]}
        return body

    def response(self, choices: list[Choice], n: int) -> dict:
        (choice,) = choices
        self.blocks = whole("".join(choice.text), self.reasoning, self.tools)
        self._cut = choice.finish_reason == "length"
        self.output_blocks = self.blocks.blocks
        self.result = self._body("completed", self.blocks.blocks, choice, usage(choices, n))
        return self.result

    # ---- the stream ---------------------------------------------------------------------------

    def _event(self, kind: str, **fields) -> bytes:
        self._seq += 1
        return sse_event({"type": kind, "sequence_number": self._seq - 1, **fields})

    def start(self) -> list[bytes]:
        body = self._body("in_progress", [], None, None)
        return [self._event("response.created", response=body), self._event("response.in_progress", response=body)]

    def chunk(self, index: int, msg: generation_pb2.GenerateResponse, include_usage: bool) -> list[bytes]:
        events = self.blocks.feed(msg.text)
        if msg.finish_reason:
            self._cut = finish_reason(msg.finish_reason) == "length"
            events += self.blocks.finish()
            self._finished = True
        return [frame for e in events for frame in self._frames(e)]

    def _frames(self, e: BlockEvent) -> list[bytes]:
        how = _STREAMS[e.block.kind]
        at = {"output_index": e.index, "item_id": self._id(e.index, e.block)}
        part = {"content_index": 0} if how.part is not None else {}
        if e.what == "open":
            out = [self._event("response.output_item.added", item=self._item(e.index, e.block, False),
                               output_index=e.index)]
            if how.part is not None:
                out.append(self._event("response.content_part.added", part=how.part, **part, **at))
            return out
        if e.what == "delta":
            return [self._event(how.delta, delta=e.delta, **how.extra, **part, **at)]
        done = self._item(e.index, e.block, True)
        if how.part is None:   # a function call: its arguments, whole
            out = [self._event(how.done, name=e.block.name, arguments=e.block.text, **at)]
        else:
            out = [self._event(how.done, text=e.block.text, **how.extra, **part, **at),
                   self._event("response.content_part.done", part=done["content"][0], **part, **at)]
        return [*out, self._event("response.output_item.done", item=done, output_index=e.index)]

    def end(self, choices: list[Choice], totals: dict, include_usage: bool) -> list[bytes]:
        if not self._finished:
            self._cut = choices[0].finish_reason == "length"
        out = [] if self._finished else [f for e in self.blocks.finish() for f in self._frames(e)]
        self.output_blocks = self.blocks.blocks
        self.result = self._body("completed", self.blocks.blocks, choices[0], totals)
        kind = "response.completed" if self.result["status"] == "completed" else "response.incomplete"
        return [*out, self._event(kind, response=self.result)]

    def stream_error(self, err: APIError) -> list[bytes]:
        """The `error` event, then `response.failed` with what was written before it."""
        code = err.code or err.type
        failed = {**self._body("failed", self.blocks.blocks, None, None), "error": {"code": code,
                                                                                   "message": err.message}}
        if self.blocks.open:   # the item the error cut short
            failed["output"][-1]["status"] = "incomplete"
        return [self._event("error", code=code, message=err.message, param=err.param),
                self._event("response.failed", response=failed)]


def _text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


@dataclass(frozen=True)
class _Stream:
    """How a block kind streams: its delta and done events, the content part it opens (None: none, a
    function call's arguments stream on the item itself), the fields its text events carry."""

    delta: str
    done: str
    part: dict | None
    extra: dict = field(default_factory=dict)


_STREAMS = {
    "text": _Stream("response.output_text.delta", "response.output_text.done", _text_part(""), {"logprobs": []}),
    "reasoning": _Stream("response.reasoning_text.delta", "response.reasoning_text.done",
                         {"type": "reasoning_text", "text": ""}),
    "tool_call": _Stream("response.function_call_arguments.delta", "response.function_call_arguments.done", None),
}


class ResponsesAPI:
    endpoint = "responses"
    path = "/v1/responses"
    x_api_key = False

    async def plan(self, gateway: Gateway, body: bytes) -> Plan:
        req = parse(ResponsesRequest, body)
        check_request(req)
        check_priority_field(req)
        limits = gateway.config.limits
        checked(limits.check_stop, req.stop)
        checked(limits.check_max_tokens, req.max_output_tokens, "max_output_tokens")
        tools = tool_use(req)
        constraint = after_thinking(text_format(req, tools), gateway.config.reasoning_parser)
        history: list[dict] = []
        if req.previous_response_id is not None:
            previous = await gateway.store.get(req.previous_response_id)
            if previous is None:
                raise APIError(400, f"Previous response with id {req.previous_response_id!r} not found.",
                               "previous_response_id", "previous_response_not_found")
            history = previous["messages"]
        new, items = input_messages(req.input)
        system = [{"role": "system", "content": req.instructions}] if req.instructions else []
        model = await gateway.catalog.get(req.model)
        ids = await chat_prompt(gateway, model, system + history + new, tools, "input")
        max_tokens = max_tokens_for(model, len(ids), req.max_output_tokens, "input", "max_output_tokens")
        sampling = make_sampling(req, max_tokens, logprobs=False, top_logprobs=0, defaults=model.sampling,
                                 max_tokens_param="max_output_tokens", constraint=constraint)
        rid = new_id("resp")
        head = {"id": rid, "object": "response", "created_at": int(time.time()), "model": model.id,
                "instructions": req.instructions, "previous_response_id": req.previous_response_id,
                "max_output_tokens": req.max_output_tokens, "temperature": sampling.params.temperature,
                "top_p": sampling.params.top_p, "tools": req.tools or [], "tool_choice": req.tool_choice or "auto",
                "parallel_tool_calls": tools.parallel if tools is not None else True, "text": format_echo(req),
                "store": req.store, "metadata": req.metadata or {}, "truncation": "disabled", "user": req.user,
                "reasoning": {"effort": None, "summary": None}, "background": False, "error": None}
        fmt = ResponsesFormat(head, model.tokenizer, gateway.config.reasoning_parser,
                              parser_for(gateway.config.tool_call_parser, tools))
        plan = Plan(self.endpoint, fmt, make_jobs(rid, model, ids, sampling, 0, 1, req.priority or 0), 1, req.stream,
                    False, constraint)
        if req.store:
            plan.finish = _keeper(gateway, fmt, history + new, items)
        return plan

    def error(self, err: APIError) -> Response:
        return err.response()


def _keeper(gateway: Gateway, fmt: ResponsesFormat, conversation: list[dict], items: list[dict]) -> Callable:
    async def keep() -> None:
        assert fmt.result is not None
        reply = output_message(fmt.output_blocks)
        messages = conversation + ([reply] if reply is not None else [])
        await gateway.store.put(fmt.result["id"], {"response": fmt.result, "input_items": items,
                                                   "messages": messages})
    return keep


API = ResponsesAPI()



def add_routes(app: FastAPI, gateway: Gateway) -> None:
    async def stored(request: Request, rid: str) -> dict:
        gateway.authorize(request)
        record = await gateway.store.get(rid)
        if record is None:
            raise not_found(rid)
        return record

    add_post(app, gateway, API)

    @app.get(API.path + "/{rid}")
    async def get(rid: str, request: Request) -> dict:
        return (await stored(request, rid))["response"]

    @app.delete(API.path + "/{rid}")
    async def delete(rid: str, request: Request) -> dict:
        gateway.authorize(request)
        if not await gateway.store.delete(rid):
            raise not_found(rid)
        return {"id": rid, "object": "response.deleted", "deleted": True}

    @app.post(API.path + "/{rid}/cancel")
    async def cancel(rid: str, request: Request) -> dict:
        await stored(request, rid)
        raise bad_request("only background responses can be cancelled; this gateway runs none (a streaming "
                          "response is cancelled by closing its connection)", "response_id")

    @app.get(API.path + "/{rid}/input_items")
    async def input_items(rid: str, request: Request, order: str = "desc", limit: int = 20,
                          after: str | None = None) -> JSONResponse:
        items = (await stored(request, rid))["input_items"]
        if order not in ("asc", "desc"):
            raise bad_request("order must be 'asc' or 'desc'", "order")
        if not 1 <= limit <= 100:
            raise bad_request("limit must be in [1, 100]", "limit")
        items = items if order == "asc" else items[::-1]
        if after is not None:
            at = next((i for i, item in enumerate(items) if item["id"] == after), None)
            if at is None:
                raise bad_request(f"after: no input item {after!r} in this response", "after")
            items = items[at + 1:]
        page = items[:limit]
        return JSONResponse({"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
                             "last_id": page[-1]["id"] if page else None, "has_more": len(items) > limit})

