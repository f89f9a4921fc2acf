"""Anthropic's Messages API on the shared pipeline: `POST /v1/messages` (whole or streamed) and
`POST /v1/messages/count_tokens`. Errors are in Anthropic's shape (errors.py), and the API key may
come as `x-api-key` as well as a Bearer token.

The content blocks are the model's output blocks (blocks.py): `thinking` (with a
`--reasoning-parser`), `text` and `tool_use`. A stream is message_start, ping, then per block
content_block_start → content_block_delta (text_delta / thinking_delta / input_json_delta) →
content_block_stop, then message_delta (stop_reason, stop_sequence, output usage) and message_stop.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse

from tandem.services.gateway.blocks import Block, BlockEvent, OutputBlocks, whole
from tandem.services.gateway.errors import APIError, bad_request
from tandem.services.gateway.limits import checked, read_body
from tandem.services.gateway.messages_items import (
    MessagesPrompt,
    MessagesRequest,
    chat_messages,
    output_format,
    system_messages,
    tool_use,
)
from tandem.services.gateway.pipeline import Gateway, Plan, add_post, chat_prompt, make_jobs, max_tokens_for
from tandem.services.gateway.protocol import check_priority_field, make_sampling, parse
from tandem.services.gateway.responses import Choice, sse_event, usage
from tandem.services.gateway.responses_items import new_id
from tandem.services.gateway.structured import after_thinking
from tandem.services.gateway.tool_formats import parser_for
from tandem.services.gateway.tools import ToolUse
from tandem.v1 import generation_pb2


def stop_reason(choice: Choice, called: bool) -> tuple[str | None, str | None]:
    """(stop_reason, stop_sequence) of a finished output, in Anthropic's words."""
    if choice.finish_reason == "length":
        return "max_tokens", None
    if choice.finish_reason == "stop":
        if isinstance(choice.matched_stop, str):
            return "stop_sequence", choice.matched_stop
        return ("tool_use" if called else "end_turn"), None
    return choice.finish_reason, None


def _block(block: Block, done: bool) -> dict:
    if block.kind == "text":
        return {"type": "text", "text": block.text if done else ""}
    if block.kind == "reasoning":
        return {"type": "thinking", "thinking": block.text if done else "", "signature": ""}
    return {"type": "tool_use", "id": block.call_id, "name": block.name, "input": block.arguments() if done else {}}


class MessagesFormat:
    def __init__(self, mid: str, model: str, prompt_tokens: int, reasoning: str | None,
                 tools: Callable[[], Any] | None):
        self.mid, self.model, self.prompt_tokens = mid, model, prompt_tokens
        self.reasoning, self.tools = reasoning, tools
        self.blocks = OutputBlocks(reasoning, tools)
        self._finished = False

    def _message(self, content: list[dict], reason: tuple[str | None, str | None], totals: dict | None) -> dict:
        used = {"input_tokens": totals["prompt_tokens"] if totals else self.prompt_tokens,
                "output_tokens": totals["completion_tokens"] if totals else 0,
                "cache_read_input_tokens": totals["prompt_tokens_details"]["cached_tokens"] if totals else 0,
                "cache_creation_input_tokens": 0}
        return {"id": self.mid, "type": "message", "role": "assistant", "model": self.model, "content": content,
                "stop_reason": reason[0], "stop_sequence": reason[1], "usage": used}

    def response(self, choices: list[Choice], n: int) -> dict:
        (choice,) = choices
        out = whole("".join(choice.text), self.reasoning, self.tools)
        return self._message([_block(b, True) for b in out.blocks], stop_reason(choice, out.called),
                             usage(choices, n))

    def start(self) -> list[bytes]:
        return [sse_event({"type": "message_start", "message": self._message([], (None, None), None)}),
                sse_event({"type": "ping"})]

    def chunk(self, index: int, msg: generation_pb2.GenerateResponse, include_usage: bool) -> list[bytes]:
        events = self.blocks.feed(msg.text)
        if msg.finish_reason:
            events += self.blocks.finish()
            self._finished = True
        return [_frame(e) for e in events]

    def end(self, choices: list[Choice], totals: dict, include_usage: bool) -> list[bytes]:
        out = [] if self._finished else [_frame(e) for e in self.blocks.finish()]
        reason, sequence = stop_reason(choices[0], self.blocks.called)
        return [*out, sse_event({"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": sequence},
                                 "usage": {"output_tokens": totals["completion_tokens"],
                                           "input_tokens": totals["prompt_tokens"],
                                           "cache_read_input_tokens": totals["prompt_tokens_details"]["cached_tokens"]}}),
                sse_event({"type": "message_stop"})]

    def stream_error(self, err: APIError) -> list[bytes]:
        return [sse_event(err.anthropic_body())]


# A block kind's delta: its type and the field that carries the text.
_DELTAS = {"text": ("text_delta", "text"), "reasoning": ("thinking_delta", "thinking"),
           "tool_call": ("input_json_delta", "partial_json")}


def _frame(e: BlockEvent) -> bytes:
    if e.what == "open":
        return sse_event({"type": "content_block_start", "index": e.index, "content_block": _block(e.block, False)})
    if e.what == "close":
        return sse_event({"type": "content_block_stop", "index": e.index})
    kind, key = _DELTAS[e.block.kind]
    return sse_event({"type": "content_block_delta", "index": e.index, "delta": {"type": kind, key: e.delta}})


async def prompt_ids(gateway: Gateway, req: MessagesPrompt, tools: ToolUse | None):
    model = await gateway.catalog.get(req.model)
    messages = system_messages(req.system) + chat_messages(req.messages)
    return model, await chat_prompt(gateway, model, messages, tools, "messages")


class MessagesAPI:
    endpoint = "messages"
    path = "/v1/messages"
    x_api_key = True

    async def plan(self, gateway: Gateway, body: bytes) -> Plan:
        req = parse(MessagesRequest, body)
        check_priority_field(req)
        if req.max_tokens < 1:
            raise bad_request(f"max_tokens: must be at least 1, got {req.max_tokens}", "max_tokens")
        req.stop = req.stop_sequences
        limits = gateway.config.limits
        checked(limits.check_stop, req.stop, "stop_sequences")
        checked(limits.check_max_tokens, req.max_tokens)
        tools = tool_use(req)
        constraint = after_thinking(output_format(req, tools), gateway.config.reasoning_parser)
        model, ids = await prompt_ids(gateway, req, tools)
        max_tokens = max_tokens_for(model, len(ids), req.max_tokens, "messages", "max_tokens")
        sampling = make_sampling(req, max_tokens, logprobs=False, top_logprobs=0, defaults=model.sampling,
                                 constraint=constraint)
        mid = new_id("msg")
        fmt = MessagesFormat(mid, model.id, len(ids), gateway.config.reasoning_parser,
                             parser_for(gateway.config.tool_call_parser, tools))
        return Plan(self.endpoint, fmt, make_jobs(mid, model, ids, sampling, 0, 1, req.priority or 0), 1, req.stream,
                    False, constraint)

    def error(self, err: APIError) -> Response:
        return err.anthropic_response()


API = MessagesAPI()



def add_routes(app: FastAPI, gateway: Gateway) -> None:
    add_post(app, gateway, API)

    @app.post(API.path + "/count_tokens")
    async def count_tokens(request: Request) -> Response:
        try:
            gateway.authorize(request, x_api_key=True)
            req = parse(MessagesPrompt, await read_body(request, gateway.config.limits.max_request_bytes))
            _, ids = await prompt_ids(gateway, req, tool_use(req))
        except APIError as e:
            return e.anthropic_response()
        return JSONResponse({"input_tokens": len(ids)})
