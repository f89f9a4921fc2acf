"""`POST /v1/chat/completions`: OpenAI's chat API on the shared pipeline (pipeline.py)."""

from __future__ import annotations

import time
import uuid

from fastapi import FastAPI, Response

from tandem.services.gateway.errors import APIError, bad_request
from tandem.services.gateway.limits import checked
from tandem.services.gateway.pipeline import Gateway, Plan, add_post, chat_prompt, make_jobs, max_tokens_for
from tandem.services.gateway.protocol import (
    ChatCompletionRequest,
    chat_messages,
    check_common,
    make_sampling,
    output_constraint,
    parse,
    tool_use,
)
from tandem.services.gateway.responses import ChatFormat, OpenAIChunks
from tandem.services.gateway.structured import after_thinking
from tandem.services.gateway.tool_formats import parser_for


class ChatCompletionsAPI:
    endpoint = "chat"
    path = "/v1/chat/completions"
    x_api_key = False

    async def plan(self, gateway: Gateway, body: bytes) -> Plan:
        req = parse(ChatCompletionRequest, body)
        check_common(req, gateway.config.max_n)
        limits = gateway.config.limits
        max_param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        requested = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        checked(limits.check_stop, req.stop)
        checked(limits.check_max_tokens, requested, max_param)
        if req.top_logprobs and not req.logprobs:
            raise bad_request("top_logprobs requires logprobs: true", "top_logprobs")
        tools = tool_use(req)
        constraint = after_thinking(output_constraint(req, tools), gateway.config.reasoning_parser)
        messages = chat_messages(req)
        model = await gateway.catalog.get(req.model)
        ids = await chat_prompt(gateway, model, messages, tools, "messages", req.chat_template_kwargs,
                                req.add_generation_prompt)
        max_tokens = max_tokens_for(model, len(ids), requested, "messages", max_param)
        sampling = make_sampling(req, max_tokens, logprobs=req.logprobs, top_logprobs=req.top_logprobs or 0,
                                 defaults=model.sampling, max_tokens_param=max_param, constraint=constraint)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        fmt = ChatFormat(rid, int(time.time()), model.id, model.tokenizer, req.logprobs,
                         tool_parser=parser_for(gateway.config.tool_call_parser, tools),
                         reasoning=gateway.config.reasoning_parser)
        return Plan(self.endpoint, OpenAIChunks(fmt), make_jobs(rid, model, ids, sampling, 0, req.n, req.priority or 0),
                    req.n, req.stream, req.include_usage, constraint)

    def error(self, err: APIError) -> Response:
        return err.response()


API = ChatCompletionsAPI()



def add_routes(app: FastAPI, gateway: Gateway) -> None:
    add_post(app, gateway, API)
