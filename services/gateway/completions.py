"""`POST /v1/completions`: OpenAI's legacy completions API on the shared pipeline (pipeline.py)."""

from __future__ import annotations

import time
import uuid

from fastapi import FastAPI, Response

from tandem.services.gateway.errors import APIError, bad_request
from tandem.services.gateway.limits import checked
from tandem.services.gateway.pipeline import Gateway, Plan, add_post, encode, make_jobs, max_tokens_for
from tandem.services.gateway.protocol import (
    CompletionRequest,
    check_common,
    check_completion,
    completion_prompts,
    make_sampling,
    output_constraint,
    parse,
)
from tandem.services.gateway.responses import CompletionFormat, OpenAIChunks


class CompletionsAPI:
    endpoint = "completions"
    path = "/v1/completions"
    x_api_key = False

    async def plan(self, gateway: Gateway, body: bytes) -> Plan:
        req = parse(CompletionRequest, body)
        check_common(req, gateway.config.max_n)
        check_completion(req)
        limits = gateway.config.limits
        checked(limits.check_stop, req.stop)
        checked(limits.check_max_tokens, req.max_tokens)
        prompts = completion_prompts(req)
        constraint = output_constraint(req)
        model = await gateway.catalog.get(req.model)
        rid = f"cmpl-{uuid.uuid4().hex}"
        jobs = []
        for p_index, prompt in enumerate(prompts):
            if isinstance(prompt, str):
                ids = await encode(model.tokenizer, prompt, add_special_tokens=True)
            else:
                ids = prompt
                if model.vocab_size and any(not 0 <= t < model.vocab_size for t in ids):
                    raise bad_request(f"prompt token ids must be in [0, {model.vocab_size})", "prompt")
            checked(limits.check_prompt_tokens, len(ids))
            max_tokens = max_tokens_for(model, len(ids), req.max_tokens, "prompt", "max_tokens")
            sampling = make_sampling(req, max_tokens, logprobs=req.logprobs is not None,
                                     top_logprobs=req.logprobs or 0, defaults=model.sampling, constraint=constraint)
            jobs += make_jobs(rid, model, ids, sampling, p_index, req.n, req.priority or 0)
        fmt = CompletionFormat(rid, int(time.time()), model.id, model.tokenizer, req.logprobs)
        return Plan(self.endpoint, OpenAIChunks(fmt), jobs, req.n, req.stream, req.include_usage, constraint,
                    operation="text_completion")

    def error(self, err: APIError) -> Response:
        return err.response()


API = CompletionsAPI()



def add_routes(app: FastAPI, gateway: Gateway) -> None:
    add_post(app, gateway, API)
